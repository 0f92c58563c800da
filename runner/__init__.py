"""amp-runner: which precision should this model train in? The engine; tasks live in `tasks/`."""

from runner.config import register as _register

_register()

CONF_DIR = __import__("pathlib").Path(__file__).resolve().parent.parent / "conf"
