"""A pooling model's `PoolerConfig`, read as vLLM reads it: from a sentence-transformers directory's files
(`modules.json`, the Pooling module's `config.json`, Dense modules' `config.json` and weights, a Normalize module),
else the architecture's defaults (decoder embedders: the last token, normalized; encoders: the first token,
normalized; classifiers: their head at that token, or at the mean ModernBERT's `classifier_pooling` may ask for,
with transformers' activation for the config's `problem_type`)."""
import json
import os
from collections.abc import Iterator

import torch
from safetensors.torch import load_file
from transformers import PretrainedConfig

from nanovllm.config import PoolerConfig
from nanovllm.layers.pooler import DenseLayer
from nanovllm.models.hf_config import is_classifier, is_encoder

MODULES_FILE = "modules.json"
# sentence-transformers' pooling modes: the new `pooling_mode` values and the older `pooling_mode_*` flags
_POOLING_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
_POOLING_FLAGS = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


def is_sentence_transformers(path: str) -> bool:
    """Whether `path` is a sentence-transformers model directory (it has `modules.json`)."""
    return os.path.isfile(os.path.join(path, MODULES_FILE))


def _read_json(path: str) -> dict | list:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable sentence-transformers file: {e}") from None


def _pooling_type(path: str) -> str:
    config = _read_json(os.path.join(path, "config.json"))
    if config.get("include_prompt") is False:
        raise ValueError(f"{path}: pooling without the prompt (include_prompt=false) is not supported")
    if "pooling_mode" in config:
        modes = [config["pooling_mode"]] if isinstance(config["pooling_mode"], str) else list(config["pooling_mode"])
        types = [_POOLING_MODES.get(mode) for mode in modes]
    else:
        modes = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
        types = [_POOLING_FLAGS.get(mode) for mode in modes]
    if len(types) != 1 or types[0] is None:
        raise ValueError(f"{path}: pooling mode {modes} is not supported; nanovllm pools by one of "
                         f"{sorted(_POOLING_MODES)}")
    return types[0]


def _classifier_activation(hf_config: PretrainedConfig) -> str:
    """transformers' loss for the config, as vLLM picks a classifier's activation from it."""
    problem = getattr(hf_config, "problem_type", None)
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    if problem == "single_label_classification":
        return "softmax"
    return "sigmoid" if hf_config.num_labels == 1 else "softmax"


def _classifier_pooling(hf_config: PretrainedConfig, default: str) -> str:
    """The rows a classifier's head reads: ModernBERT's `classifier_pooling` ("cls" or "mean"), else `default`."""
    pooling = getattr(hf_config, "classifier_pooling", None)
    if pooling is None:
        return default
    if pooling not in ("cls", "mean"):
        raise ValueError(f"classifier_pooling {pooling!r} in the model config is not supported; nanovllm runs 'cls' "
                         "and 'mean'")
    return pooling.upper()


def read_pooler_config(path: str, hf_config: PretrainedConfig) -> PoolerConfig:
    """How the model at `path` pools (see the module's docstring); a ValueError naming a module or mode nanovllm does
    not run."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    matryoshka = dict(is_matryoshka=bool(getattr(hf_config, "is_matryoshka", False) or dims),
                      matryoshka_dimensions=tuple(dims) if dims else None)
    default = "CLS" if is_encoder(hf_config) else "LAST"
    if is_classifier(hf_config):
        return PoolerConfig(_classifier_pooling(hf_config, default), normalize=False, num_labels=hf_config.num_labels,
                            activation=_classifier_activation(hf_config), **matryoshka)
    if not is_sentence_transformers(path):
        return PoolerConfig(default, **matryoshka)
    pooling_type, normalize, dense = default, False, []
    for module in _read_json(os.path.join(path, MODULES_FILE)):
        kind, folder = module.get("type", "").rsplit(".", 1)[-1], os.path.join(path, module.get("path", ""))
        if kind == "Transformer":
            if os.path.normpath(folder) != os.path.normpath(path):
                raise ValueError(f"{path}: the Transformer module is in {module['path']!r}; nanovllm reads the model "
                                 "from the directory itself")
        elif kind == "Pooling":
            pooling_type = _pooling_type(folder)
        elif kind == "Dense":
            dense.append(folder)
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(f"{path}: sentence-transformers module {module.get('type')!r} is not supported; nanovllm "
                             "runs Transformer, Pooling, Dense and Normalize modules")
    return PoolerConfig(pooling_type, normalize, tuple(dense), **matryoshka)


def write_pooling_modules(path: str | os.PathLike, pooling_mode: str, dimension: int) -> None:
    """Make `path` (a model directory) a sentence-transformers one that pools the `dimension`-wide hidden states by
    `pooling_mode` and normalizes: `modules.json` naming the Transformer (the directory itself), a Pooling module and
    a Normalize module, as `read_pooler_config` and sentence-transformers read them (how a GGUF embedding file's
    pooling is kept in its metadata directory)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": dimension, "pooling_mode": pooling_mode}, f)
    with open(os.path.join(path, MODULES_FILE), "w") as f:
        json.dump(modules, f, indent=2)


def dense_config(folder: str) -> tuple[int, int, bool, str]:
    """A Dense module's input and output sizes, whether it has a bias, and its activation's torch.nn class name."""
    config = _read_json(os.path.join(folder, "config.json"))
    activation = config.get("activation_function", "torch.nn.modules.linear.Identity").rsplit(".", 1)[-1]
    return config["in_features"], config["out_features"], config.get("bias", True), activation


def dense_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A Dense module's tensors (`linear.weight`, `linear.bias`), from safetensors or a PyTorch file."""
    file = os.path.join(folder, "model.safetensors")
    if os.path.isfile(file):
        yield from load_file(file).items()
        return
    file = os.path.join(folder, "pytorch_model.bin")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in the Dense module {folder!r}")
    yield from torch.load(file, map_location="cpu", weights_only=True).items()


def dense_layers(config: PretrainedConfig, pooler_config: PoolerConfig) -> list[DenseLayer]:
    """The Dense modules of `pooler_config`, in order, built (weights not loaded); a ValueError when one's input is
    not the previous one's output (the model's hidden size for the first)."""
    layers = []
    for folder in pooler_config.dense_dirs:
        in_features, out_features, bias, activation = dense_config(folder)
        expected = layers[-1].linear.out_features if layers else config.hidden_size
        if in_features != expected:
            raise ValueError(f"the Dense module {folder!r} takes {in_features} features, but {expected} come into it")
        layers.append(DenseLayer(in_features, out_features, bias, activation))
    return layers


def dense_tensors(folders: tuple[str, ...]) -> Iterator[tuple[str, torch.Tensor]]:
    """The Dense modules' tensors under the pooler's names (`pooler.dense.{i}.linear.weight`)."""
    for i, folder in enumerate(folders):
        for name, tensor in dense_weights(folder):
            yield f"pooler.dense.{i}.{name}", tensor
