"""A GGUF file's config, tokenizer and tensor table, read once per file into the cache.

`LLM("model.gguf")` reads the weights from the file itself, as they are (`nanovllm.models.gguf.weights`); its config
(rebuilt from the metadata, `nanovllm.models.gguf.config`), tokenizer (transformers' GGUF tokenizer reader) and tensor
table are read once per file, with the `gguf` package, into a small directory in the cache (`$NANOVLLM_CACHE`,
default `~/.cache/nanovllm`; `cached_metadata`).
"""
import contextlib
import functools
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import xxhash
from transformers import AutoConfig, PretrainedConfig

from nanovllm.cache import cache_dir
from nanovllm.models.gguf.config import Metadata, gguf_config, pooling_mode
from nanovllm.models.gguf.weights import ROPE_FACTORS, TENSORS, tensor_table
from nanovllm.models.sentence_transformers import write_pooling_modules
from nanovllm.progress import Progress

INSTALL_HINT = 'pip install "nanovllm[demo]" (or: pip install gguf accelerate)'


def find_gguf(path: str, marker: str = "config.json", what: str = "model",
              other: str = "a model directory") -> str | None:
    """The GGUF file `path` stands for: the path itself, or the one .gguf in a directory without `marker` (the file
    of a directory in the other format, `other`; None for such a directory). `what` names the path in errors."""
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{what} {path!r} is a file but not a .gguf file; pass {other} or a .gguf file")
        return path
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, marker)):
        return None
    found = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
    if len(found) > 1:
        raise ValueError(f"{what} {path!r} holds several GGUF files {found}; pass the path of one of them")
    return os.path.join(path, found[0]) if found else None


def require_gguf_support(packages: tuple[str, ...] = ("gguf", "accelerate")) -> None:
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(f"reading GGUF files needs the {' and '.join(missing)} package(s): {INSTALL_HINT}")


def file_metadata(reader, path: str) -> Metadata:
    """A parsed GGUF file's metadata and tensor shapes (`nanovllm.models.gguf.config.Metadata`), the vocabulary
    left out."""
    from gguf import GGUFValueType

    fields = {key: field.contents() for key, field in reader.fields.items()
              if not (field.types and field.types[0] == GGUFValueType.ARRAY and key.startswith("tokenizer.ggml."))}
    return Metadata(fields, {t.name: [int(n) for n in t.shape] for t in reader.tensors}, path)


def read_gguf_config(metadata: Metadata, reader) -> PretrainedConfig:
    """The model config recorded in the file's metadata (`nanovllm.models.gguf.config`), with its `architectures`; no
    weight is read (but Phi-3's small LongRoPE factor tensors)."""
    factors = {t.name: [float(x) for x in t.data] for t in reader.tensors if t.name in ROPE_FACTORS}
    settings = gguf_config(metadata, factors)
    return AutoConfig.for_model(settings.pop("model_type"), **settings)


def reject_scaled_rope(path: str) -> None:
    """llama.cpp stores Llama 3.1's rope scaling as a `rope_freqs` tensor, whose settings the file does not keep, and
    transformers' GGUF reader (`nanovllm.models.gguf.convert`) drops every rope scaling: either would change every
    output, so such files are refused rather than run or converted wrongly."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(f"{path} scales its rope frequencies (e.g. Llama 3.1/3.2), which nanovllm cannot read from "
                         "GGUF files; load the model's original Hugging Face checkpoint instead")


_PATCHING = threading.Lock()  # one conversion at a time patches gguf-py, so each restores what it found


@contextlib.contextmanager
def parsed_once(progress: Progress):
    """Within it, gguf-py parses each GGUF file once, builds each tensor-name table once, and counts the tensors
    it dequantizes into `progress`.

    A conversion has transformers parse the whole file five times (the config, checked first and again for the
    tokenizer and the model, the weights, and our rope check), each a walk over the 49k-token vocabulary in Python
    taking seconds; and build gguf-py's name table anew for each of the model's modules. Both are only read, so one
    of each is shared. The shared reader also slices a plain array view of its memory map, not the `np.memmap`
    itself, whose slicing costs ~3x more.
    """
    import gguf

    with _PATCHING:
        saved = gguf.GGUFReader, gguf.get_tensor_name_map, gguf.dequantize

        class Reader(saved[0]):
            @property
            def data(self):
                return self._plain

            @data.setter
            def data(self, mapped):
                self._plain = mapped.view(np.ndarray)

        def dequantize(data, qtype):
            progress.advance()
            return saved[2](data, qtype)

        read = functools.cache(Reader)
        gguf.GGUFReader = lambda path, mode="r": read(os.path.realpath(path), mode)
        gguf.get_tensor_name_map, gguf.dequantize = functools.cache(saved[1]), dequantize
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map, gguf.dequantize = saved


HEADER_BYTES = 1 << 20
SAMPLES, SAMPLE_BYTES = 64, 1 << 16
SOURCES = "sources.json"
FORMAT = 3  # of an entry's contents, part of its key: 2 added an embedding file's sentence-transformers pooling
# files, 3 their Pooling module's dimension (which sentence-transformers needs to read a converted directory)


def content_key(path: str) -> str:
    """A key of the GGUF file's content: xxh64 of the entries' `FORMAT`, the file's size, its first MiB (the header:
    metadata, vocabulary and tensor table) and 64 evenly spaced 64 KiB samples of the tensor data. An entry written
    in an older format is not found, and is deleted once its file reads into a new one.

    Not the whole file: hashing a multi-GB model on every start would cost seconds, while two different models,
    or two quantizations of one, already differ in their header or in the sampled tensor bytes.
    """
    size = os.path.getsize(path)
    digest = xxhash.xxh64(f"{FORMAT}:{size}".encode())
    with open(path, "rb") as f:
        digest.update(f.read(HEADER_BYTES))
        for i in range(SAMPLES):
            f.seek(HEADER_BYTES + max(size - HEADER_BYTES, 0) * i // SAMPLES)
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def _read_sources(conversion: Path) -> list[str]:
    try:
        return json.loads((conversion / SOURCES).read_text())
    except (OSError, ValueError):
        return []


def _write_sources(conversion: Path, sources: list[str]) -> None:
    tmp = conversion / f".{SOURCES}.{os.getpid()}"
    tmp.write_text(json.dumps(sorted(set(sources))))
    os.replace(tmp, conversion / SOURCES)


def _drop_stale(keep: Path, source: str) -> None:
    """`source` now reads into `keep`: forget it in every other entry, and delete the entries that no existing file
    names any more."""
    for other in keep.parent.iterdir():
        if other == keep or not other.is_dir() or other.name.startswith("."):
            continue
        sources = [s for s in _read_sources(other) if s != source and os.path.isfile(s)]
        if sources:
            _write_sources(other, sources)
        else:
            shutil.rmtree(other, ignore_errors=True)


def cached_metadata(path: str, progress: Progress | None = None) -> Path:
    """The directory of the GGUF file at `path`'s config.json, tokenizer files and tensor table (`TENSORS`), written
    on first use; no weight is ever written.

    The cache is keyed by the file's content (`content_key`), so copies of one file (in several virtualenvs, say)
    share one entry, and an edited or replaced file gets its own; each entry records the files it was made from, and
    one that no existing file names any more is deleted. The file is checked (architecture, tensor types, size) before
    the slow part, and an entry becomes visible only when complete (written to a temporary directory, then renamed).
    `progress`: that of a caller already inside `parsed_once` (a conversion), which reports the writing.
    """
    require_gguf_support(("gguf",))
    source, key, cache = os.path.abspath(path), content_key(path), cache_dir() / "gguf-metadata"
    found = [entry for entry in cache.glob(f"*-{key}") if (entry / TENSORS).is_file()]
    target = found[0] if found else cache / f"{Path(path).stem}-{key}"
    if not (target / TENSORS).is_file():
        _write_metadata_into(path, target, progress)
    if source not in _read_sources(target):
        _write_sources(target, [*_read_sources(target), source])
        _drop_stale(target, source)
    return target


def _write_metadata_into(path: str, target: Path, progress: Progress | None) -> None:
    if progress is None:
        print(f"nanovllm: reading the config and tokenizer of {path} into {target} (once; later runs reuse them) ...",
              file=sys.stderr)
        with Progress("read the GGUF metadata") as progress, parsed_once(progress):
            return _write_metadata_into(path, target, progress)
    import gguf

    progress("reading the GGUF file")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file ({e}); it may be truncated or corrupt: download or "
                         "convert it again") from None
    metadata = file_metadata(reader, path)
    pooling = pooling_mode(metadata)  # a reranker is refused for what it is, before its head's tensors are
    table = tensor_table(reader, path)
    reject_scaled_rope(path)
    config = read_gguf_config(metadata, reader)
    progress("building the tokenizer")
    tokenizer = tokenizer_of(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if pooling:
            write_pooling_modules(tmp, pooling, config.hidden_size)
        (tmp / TENSORS).write_text(json.dumps(table))
        os.rename(tmp, target)
    except OSError:
        if not (target / TENSORS).is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


TOKENIZERS_READ_FROM = "5.18"
"""The first transformers release whose GGUF reader builds the tokenizers of every family nanovllm runs from GGUF files
(5.17 refuses Granite, OLMo 2, GPT-NeoX and Gemma files, and fails on a file without a BOS token)."""


def tokenizer_of(path: str):
    """The file's tokenizer, by transformers' GGUF tokenizer reader: the class transformers picks for the
    architecture, or the plain fast tokenizer for architectures transformers does not run from GGUF files; a BERT
    file's WordPiece vocabulary, which transformers does not read, by `wordpiece_tokenizer`."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers import __version__ as transformers_version
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    source = dict(pretrained_model_name_or_path=os.path.dirname(os.path.abspath(path)),
                  gguf_file=os.path.basename(path))
    fields = GGUFReader(path).fields
    if (model := fields.get("tokenizer.ggml.model")) is not None and model.contents() == "bert":
        return wordpiece_tokenizer(fields)
    architecture = fields["general.architecture"].contents()
    known = architecture in GGUF_SUPPORTED_ARCHITECTURES or architecture.replace("moe", "_moe") in \
        GGUF_SUPPORTED_ARCHITECTURES
    try:
        return (AutoTokenizer if known else PreTrainedTokenizerFast).from_pretrained(**source)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"transformers {transformers_version} could not build the tokenizer of {path} ({type(e).__name__}: {e}); "
            f"transformers {TOKENIZERS_READ_FROM} or newer reads those of every architecture nanovllm runs from GGUF "
            f"files: pip install -U 'transformers>={TOKENIZERS_READ_FROM}'") from e


PHANTOM_SPACE = "\u2581"
CONTROL = 3  # gguf.TokenType.CONTROL
# a BERT vocabulary's special tokens: their ids' keys, and llama.cpp's ids where the file has none (BERT's own)
BERT_SPECIAL = {"cls_token": ("bos_token_id", 101), "sep_token": ("seperator_token_id", 102),
                "unk_token": ("unknown_token_id", 100), "pad_token": ("padding_token_id", 0),
                "mask_token": ("mask_token_id", 103)}


def wordpiece_tokenizer(fields: dict):
    """A BERT file's WordPiece vocabulary (llama.cpp's `bert` tokenizer) as a transformers fast tokenizer that
    tokenizes as the model's own: llama.cpp's converter spells a word's first piece with a leading "\u2581" and
    continuations bare, so each is turned back (continuations to "##" pieces); lowercased and accents stripped unless
    the file says otherwise (llama.cpp's defaults); "[CLS] text [SEP]", a pair's second text and its [SEP] of token
    type 1."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    def value(key: str, default=None):
        return fields[key].contents() if key in fields else default

    tokens = zip(value("tokenizer.ggml.tokens"), value("tokenizer.ggml.token_type"))
    pieces = [token if kind == CONTROL else token[1:] if token.startswith(PHANTOM_SPACE) else "##" + token
              for token, kind in tokens]
    vocab: dict[str, int] = {}
    for index, piece in enumerate(pieces):
        vocab.setdefault(piece, index)
    special = {name: pieces[value(f"tokenizer.ggml.{key}", default)] for name, (key, default) in BERT_SPECIAL.items()}
    lowercase = bool(value("tokenizer.ggml.normalizer.lowercase", True))
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=special["unk_token"]))
    tokenizer.normalizer = normalizers.BertNormalizer(
        lowercase=lowercase, strip_accents=bool(value("tokenizer.ggml.normalizer.strip_accents", lowercase)))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    cls, sep = special["cls_token"], special["sep_token"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special,
                                   model_input_names=["input_ids", "token_type_ids", "attention_mask"])
