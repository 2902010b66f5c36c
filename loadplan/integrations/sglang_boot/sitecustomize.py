"""Start-up hook of `loadplan sglang-run`: installs loadplan's SGLang adapter in every
Python process the command starts (SGLang's launcher, its scheduler per rank, ...).

`loadplan sglang-run` prepends this directory to PYTHONPATH and sets LOADPLAN_SGLANG=1,
so Python imports this module at start-up, as tracing tools do. A process whose Python
has no SGLang is left alone; one with an SGLang older than the loader step the adapter hooks
stops, saying so. An environment's own sitecustomize is still run after this one.
"""

import os
import sys


def _run_next_sitecustomize():
    """Run the sitecustomize this one shadows, if the environment has one."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or ".") == here:
            continue
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_loadplan_next_sitecustomize", candidate)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


def _install():
    if os.environ.get("LOADPLAN_SGLANG") != "1":
        return
    try:
        from loadplan.integrations import sglang as adapter
    except ImportError:     # a Python without loadplan (a helper tool the command runs)
        return
    if adapter.sglang_version() is None:
        return              # a Python without SGLang: nothing to put the registry in front of
    try:
        adapter.install()
    except adapter.SglangVersionError as e:
        # An exception here would only be printed, and the process would go on without the
        # adapter: stop it, as install() refuses, before it runs anything.
        sys.stderr.write(f"loadplan sglang-run: {e}\n")
        sys.stderr.flush()
        os._exit(2)


_install()
_run_next_sitecustomize()
