"""What nanovllm's programs (`python -m nanovllm`, example.py, bench.py) do first, before their slow imports: Ctrl-C
ends them with one line instead of a traceback."""
import sys


def quiet_ctrl_c() -> None:
    """Make Ctrl-C print "interrupted" instead of a traceback from wherever it struck (most often deep in torch).

    Only the report changes: the KeyboardInterrupt still unwinds (`with LLM(...)` stops the engine's child
    processes, which ignore Ctrl-C themselves), and Python still ends as killed by SIGINT, which a shell reports
    as status 130 and which stops a shell loop running the program."""
    previous = sys.excepthook

    def excepthook(kind, error, traceback) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            return previous(kind, error, traceback)
        # sys.__stderr__: torch.distributed wraps this hook to prefix "[rank0]: " to what it writes to sys.stderr
        stderr = sys.__stderr__ or sys.stderr
        # a terminal shows "^C" where the output stopped: start a line of our own
        print("\ninterrupted" if stderr.isatty() else "interrupted", file=stderr)

    sys.excepthook = excepthook
