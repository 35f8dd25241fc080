"""A GGUF file (llama.cpp's one-file format) as the HF directory every rlfleet component loads.

Conversion, done by transformers (`from_pretrained(..., gguf_file=)`, which reads the file with the `gguf`
package; only the caching here is ours): the file's metadata becomes the config; its tensors are
dequantized (Q4_1 blocks and the like become floats) in the run's dtype and renamed to transformers' names,
with llama.cpp's reordering of the query and key rows undone; a file without `output.weight` gives tied
embeddings; its tokenizer metadata (vocabulary, merges, special ids, chat template) becomes a tokenizer.
`GgufConfig(dequantize=True)` asks for dense weights even where transformers could keep the blocks packed
(with the `kernels` package), so that the model saves as an ordinary safetensors checkpoint. `save_pretrained`
writes config.json, model.safetensors (a tied head once), generation_config.json (bos, eos and pad ids from the
file), tokenizer.json, tokenizer_config.json and chat_template.jinja when the file has a template.

Cached: `$RLFLEET_CACHE/gguf/KEY`, KEY = sha256 of CONVERSION, the file's identity and the dtype. The caller
names the identity: a local file's real path, size and modification time (`file_identity`: a changed file gets
a new conversion, an unchanged one is never read again, even to hash it); an S3 object's endpoint, bucket, key,
size and ETag; a hub file's blob, which huggingface_hub names by its ETag. Written to a temporary directory and
renamed into place (builtin.publish), so concurrent resolvers never see half a model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import tempfile
from pathlib import Path

from rlfleet.models.builtin import cache_root, publish

CONVERSION = 1  # part of the cache key: bump it when the directory written for the same file changes
GGUF_MAGIC = b"GGUF"
GGUF_DOCS = "https://huggingface.co/docs/transformers/gguf"


class UnreadableGguf(ValueError):
    """The file is no GGUF that transformers can read; the message says why and the fix."""


def file_identity(file: Path) -> str:
    """A local file's cache identity: its real path (a hub snapshot's file resolves to its ETag-named blob),
    size and modification time."""
    stat = file.stat()
    return f"file {file.resolve()} {stat.st_size} {stat.st_mtime_ns}"


def conversion_dir(identity: str, dtype: str) -> Path:
    """Where the conversion of the file of `identity` in `dtype` is cached (it may not exist yet)."""
    key = hashlib.sha256(f"{CONVERSION}\n{identity}\n{dtype}".encode()).hexdigest()[:24]
    return cache_root() / "gguf" / key


def is_converted(dest: Path) -> bool:
    return (dest / "config.json").exists()


def convert(gguf_file: Path, dest: Path, dtype: str) -> Path:
    """`dest` holding `gguf_file` as an HF directory in `dtype` (module docstring): cached, else converted now.
    Raises UnreadableGguf for a file transformers cannot read."""
    if is_converted(dest):
        return dest
    check_gguf(gguf_file)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".convert-"))
    try:
        write_hf_dir(gguf_file, tmp, dtype)
        publish(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def check_gguf(gguf_file: Path) -> None:
    """What can be told before transformers starts: the file is a GGUF, and the `gguf` package is there."""
    with open(gguf_file, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise UnreadableGguf(
            f"{str(gguf_file)!r} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); name a .gguf "
            f"file as llama.cpp writes it, or an HF model directory"
        )
    if importlib.util.find_spec("gguf") is None:
        raise UnreadableGguf(
            "reading a GGUF file needs the gguf package, which is not installed here; `pip install gguf` "
            "(rlfleet[train] brings it)"
        )


def write_hf_dir(gguf_file: Path, out: Path, dtype: str) -> None:
    """Dequantize `gguf_file` into the HF directory `out` (module docstring)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from rlfleet.models.policy import DTYPES

    folder, name = str(gguf_file.parent), str(gguf_file)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=DTYPES[dtype], quantization_config=GgufConfig(dequantize=True)
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # What transformers raises for a GGUF it cannot read: ValueError for an architecture or a tensor type it
    # does not support, KeyError for metadata the file lacks (no tokenizer, no block count), NotImplementedError
    # for a quantization gguf cannot dequantize. Anything else is a defect to see whole, so it propagates.
    except (ValueError, KeyError, NotImplementedError) as exc:
        import transformers

        raise UnreadableGguf(
            f"transformers {transformers.__version__} cannot read this GGUF file ({type(exc).__name__}: {exc}); "
            f"use a GGUF of an architecture and quantization it supports ({GGUF_DOCS}), or give the model as an "
            f"HF directory (hf://ORG/NAME of the original model)"
        ) from None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
