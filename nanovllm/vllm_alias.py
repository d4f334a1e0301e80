"""`as_vllm()`: code written for vLLM's offline API imports nanovllm under vLLM's name, unchanged.

`import vllm` then gives the `nanovllm` module itself, and `vllm.X.Y` the module `nanovllm.X.Y` (the same module
object, so `vllm.SamplingParams is nanovllm.SamplingParams`), for every module nanovllm has under vLLM's path with the
package name changed (`nanovllm.sampling_params`, `nanovllm.outputs`, `nanovllm.inputs`, `nanovllm.lora.request`,
`nanovllm.tokenizers`, `nanovllm.renderers.hf`, `nanovllm.v1.sample.logits_processor`, ...); a path nanovllm does not
have is a ModuleNotFoundError, as for a vLLM release without it. `importlib.metadata.version("vllm")`, which clients
read to choose between vLLM releases' import paths, says `VLLM_VERSION`, the release whose offline API nanovllm
follows. Nothing of the client is changed: this is an import alias, put first on `sys.meta_path` (ahead of an
installed vLLM), that leaves every module already imported as it is.
"""
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from collections.abc import Iterator
from importlib import import_module
from types import ModuleType

VLLM_VERSION = "0.32.0"
"""The vLLM release whose offline API nanovllm follows, and against which it is measured (docs/benchmarks.md)."""

_METADATA = f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\nSummary: nanovllm under vLLM's name\n"


class _AliasLoader(importlib.abc.Loader):
    """Loads `vllm.X` as the already imported `nanovllm.X`: the module object itself, not run again, its attributes
    as they were (the import system sets `__spec__` to the alias's spec in between: it is put back)."""

    def __init__(self, module: ModuleType):
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec


class _Distribution(importlib.metadata.Distribution):
    """The `vllm` distribution `importlib.metadata` finds while the alias is installed: its name and version only."""

    def read_text(self, filename: str) -> str | None:
        return _METADATA if filename in ("METADATA", "PKG-INFO") else None

    def locate_file(self, path: str):
        return None


class VllmAlias(importlib.abc.MetaPathFinder):
    """The finder `as_vllm` puts first on `sys.meta_path`: `vllm` and `vllm.*` imports resolve to nanovllm's modules,
    and `importlib.metadata` finds a `vllm` distribution of version `VLLM_VERSION`. `remove()` undoes it."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "vllm" and not fullname.startswith("vllm."):
            return None
        name = "nanovllm" + fullname[len("vllm"):]
        try:
            if importlib.util.find_spec(name) is None:
                return None
        except ModuleNotFoundError:  # a parent package nanovllm does not have
            return None
        module = import_module(name)
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(module), is_package=hasattr(module, "__path__"))

    def find_distributions(self, context: importlib.metadata.DistributionFinder.Context | None = None
                           ) -> Iterator[_Distribution]:
        name = None if context is None else context.name
        if name is None or name.lower().replace("_", "-") == "vllm":
            yield _Distribution()

    def remove(self) -> None:
        """Take the alias away: `import vllm` finds what it would have found without it (a real vLLM, or nothing).
        Modules that imported vllm meanwhile keep the nanovllm objects they hold."""
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for name in [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]:
            del sys.modules[name]


def as_vllm() -> VllmAlias:
    """Make `import vllm` (and `vllm.X.Y`, and `importlib.metadata.version("vllm")`) give nanovllm, for clients
    written for vLLM's offline API (see the module); returns the alias (`remove()` undoes it). Call it before the
    client imports vllm; calling it again returns the same alias. A RuntimeError if a real vLLM is imported already
    (its objects would be held beside nanovllm's)."""
    imported = sys.modules.get("vllm")
    if imported is not None and imported is not sys.modules["nanovllm"]:
        raise RuntimeError(f"vllm is imported already (from {getattr(imported, '__file__', None)!r}): call as_vllm() "
                           "before anything imports vllm")
    alias = next((finder for finder in sys.meta_path if isinstance(finder, VllmAlias)), None)
    if alias is None:
        alias = VllmAlias()
        sys.meta_path.insert(0, alias)
    import_module("vllm")
    return alias
