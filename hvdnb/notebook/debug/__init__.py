"""JupyterLab's visual debugger across the ranks.

- ``router``: wraps the kernel's debugger; the ranks' sessions, and the ids the page sees;
- ``dap``: a Debug Adapter Protocol client for one rank's debugpy.
"""
