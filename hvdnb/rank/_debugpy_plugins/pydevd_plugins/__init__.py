# pydevd's namespace for extensions: each folder on sys.path may add to it
import pkgutil

__path__ = pkgutil.extend_path(__path__, __name__)
