"""``python -m kernels_ext.engine [ipengine args]``: the command hvdnb's launchers run on
every rank. A thin bootstrap kept at this path so that launch commands and kernels made by an
earlier hvdnb keep working; the engine itself lives in ``hvdnb.rank.engine``."""

from __future__ import annotations

if __name__ == "__main__":
    from hvdnb.rank.engine import main

    main()
