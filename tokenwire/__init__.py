"""tokenwire: a minimum-latency LLM inference server.

`tokenwire.Server` (server.py) embeds the server in-process; the `tokenwire` command line (cli.py)
builds engines, serves them and runs the benchmarks. Heavy modules load on first use,
so `import tokenwire` stays cheap.
"""

__version__ = "0.1.0"
__all__ = ["Server", "__version__"]


def __getattr__(name):
    if name == "Server":
        from .server import Server
        return Server
    raise AttributeError(f"module 'tokenwire' has no attribute {name!r}")
