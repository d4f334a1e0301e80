"""What nanovllm's programs (`python -m nanovllm`, example.py, bench.py) do first, before their slow imports: Ctrl-C
ends them with one line instead of a traceback, and a folder hiding the installed package is named."""
import atexit
import os
import signal
import sys


def quiet_ctrl_c() -> None:
    """Make Ctrl-C print "interrupted" instead of a traceback from wherever it struck (most often deep in torch).

    Only the report changes: the KeyboardInterrupt still unwinds (`with LLM(...)` stops the engine's child
    processes, which ignore Ctrl-C themselves), and the program still ends as killed by SIGINT, which a shell reports
    as status 130 and which stops a shell loop running the program. Python would end so by itself, but an exit
    handler that runs code (torch's dynamo registers one once transformers imports it) makes it exit with status 1:
    so after every other exit handler (this one is registered first, and they run last-registered first) the program
    ends itself by SIGINT."""
    previous = sys.excepthook
    interrupted = []

    def excepthook(kind, error, traceback) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            return previous(kind, error, traceback)
        interrupted.append(True)
        # sys.__stderr__: torch.distributed wraps this hook to prefix "[rank0]: " to what it writes to sys.stderr
        stderr = sys.__stderr__ or sys.stderr
        # a terminal shows "^C" where the output stopped: start a line of our own
        print("\ninterrupted" if stderr.isatty() else "interrupted", file=stderr)

    def end_as_interrupted() -> None:
        if interrupted and os.name == "posix":
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:
                    stream.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)

    sys.excepthook = excepthook
    atexit.register(end_as_interrupted)


def refuse_shadowed_package() -> None:
    """Exit with a message naming the folder when `nanovllm` was imported from a folder that is not the package.

    With an editable install (`pip install -e`), a folder named nanovllm in the current directory (on sys.path for
    `python -m`, `python -c` and the REPL), such as the clone seen from its parent directory, is imported as an
    empty namespace package, and `from nanovllm import LLM` fails with "cannot import name 'LLM' from 'nanovllm'
    (unknown location)". The editable install still finds the package's modules, this one included."""
    package = sys.modules["nanovllm"]
    if getattr(package, "__file__", None) is not None:
        return
    folder = next(iter(package.__path__))
    if os.path.isfile(os.path.join(folder, "nanovllm", "__init__.py")):
        hint = f"run from inside the clone (cd {folder}) or from anywhere else"
    else:
        hint = "rename it or run from another directory"
    print(f"error: the folder {folder} shadows the installed nanovllm package; {hint}", file=sys.stderr)
    sys.exit(2)
