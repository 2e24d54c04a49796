"""Bad values given to hvdnb's public functions in the notebook's kernel: each is refused
with what was wrong and what is taken, as a TypeError or ValueError, and IPython shows the
user's frames only (``_render_traceback_``: no frame of hvdnb's). No processes: the checks
run before anything starts. The ranks' side (``hvdnb.log``, ``hvdnb.knobs`` in a cell) is
``tests/integration/test_bad_input.py``'s."""

from __future__ import annotations

import pytest

import hvdnb

CASES = [
    (lambda: hvdnb.metrics(5), TypeError, "name must be a metric's name"),
    (lambda: hvdnb.metrics("loss", rank="a"), TypeError, "rank must be a rank's number"),
    (lambda: hvdnb.metrics(run=1.5), TypeError, "run must be a run of this session"),
    (lambda: hvdnb.set_knobs(), ValueError, "no knob values given"),
    (lambda: hvdnb.watch(nan="maybe"), ValueError, "nan='maybe': use one of warn, stop, off"),
    (lambda: hvdnb.import_runs(5), TypeError, "path must be a directory"),
    (lambda: hvdnb.phase(5).__enter__(), TypeError, "name must be a phase's name"),
    (lambda: hvdnb.run_cell(None, "1"), TypeError, "run_cell needs an hvdnb.Cluster"),
    (lambda: hvdnb.ddp_comm_hook(5), TypeError, "wrapped in torch's DistributedDataParallel"),
    (lambda: hvdnb.elastic.run(5), TypeError, "decorates the training function"),
    (lambda: hvdnb.require_ranks("x"), ValueError, "a number of ranks >= 1, not 'x'"),
    (lambda: hvdnb.knobs(batch_size="big"), TypeError, "knob batch_size='big' is str"),
    (lambda: hvdnb.knobs(lr=0.1, ranges={"lr": (2, 1)}), ValueError, "min is above max"),
    (lambda: hvdnb.log(0, "low"), TypeError, "loss must be a number, not str"),
    (lambda: hvdnb.Cluster(n="two"), hvdnb.ClusterError, "-n must be a whole number"),
    (lambda: hvdnb.tf_cluster_resolver(5), hvdnb.ClusterError, "takes an hvdnb.Cluster"),
]


@pytest.mark.parametrize("call, kind, words", CASES, ids=[c[2][:30] for c in CASES])
def test_a_bad_value_is_refused_saying_what_and_showing_no_hvdnb_frame(call, kind, words):
    with pytest.raises(kind, match=words.replace("(", r"\(").replace(")", r"\)")) as info:
        call()
    render = getattr(info.value, "_render_traceback_", None)
    assert render is not None, f"{type(info.value).__name__} is shown with hvdnb's frames"
    text = "\n".join(render())
    assert "/hvdnb/" not in text, text  # the user's frames only
    assert "test_public_bad_input.py" in text, text  # ... ending at the user's line
    assert text.splitlines()[-1].startswith(f"{kind.__name__}: "), text
