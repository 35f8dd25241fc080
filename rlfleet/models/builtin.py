"""Built-in models, made in code so nothing is downloaded: `builtin://tiny-arithmetic`, `builtin://tiny-math`.

Each is a small Qwen2-architecture causal LM with a character-level tokenizer over its own
characters (built with `tokenizers`), saved in HF format (config.json, tokenizer.json,
model.safetensors). It gets a short supervised warm start on the run's task so that RL starts with
signal: the warm-started policy solves some problems when sampled at temperature 1 and RL sharpens
it. tiny-arithmetic writes bare integers for the arithmetic task; tiny-math writes `\\boxed{answer}`
for the math task over builtin://tiny-math (rlfleet/tasks/samples/tiny-math.jsonl, made by
scripts/make_tiny_math.py), whose characters its tokenizer covers; a data set with other characters is
refused when the model is built.

vLLM's CPU attention needs a head size of at least 32: tiny-math (hidden 96, 3 heads of 32) runs on
`engine: torch` or `engine: vllm`; tiny-arithmetic (head size 16) on torch only.

Building is deterministic for a given (builtin recipe, task spec, seed, steps, BUILD_VERSION); the
cache key hashes all of them, so changing a builtin's architecture or warm-start recipe gets a new
build without touching the others' (BUILD_VERSION is for changes to the build code itself). The
result is cached under $RLFLEET_CACHE (default ~/.cache/rlfleet) and written atomically, so
concurrent builders never see a half-written model.

Shipped builds: the examples' builds (about 3.5 MB together) ship in the package, `weights/NAME-KEY/`,
written by `scripts/ship_builtins.py`; a build whose key is shipped is used from there, so a first
run starts in seconds instead of minutes of warm start. Any other key is built (with a progress
callback) and cached as before. tests/core/test_builtin.py fails when an example's key has no
shipped build, i.e. when a recipe, task or build change needs `scripts/ship_builtins.py` rerun.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlfleet.wire import env

BUILD_VERSION = 2
BUILTIN_PREFIX = "builtin://"
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]
CHARS = "0123456789+-= "  # tiny-arithmetic's
MATH_CHARS = "0123456789+-*/=?x,\\boed{}"  # tiny-math's: its problems and `\\boxed{...}` answers
SHIPPED = Path(__file__).parent / "weights"  # prebuilt builds of the examples (scripts/ship_builtins.py)
# The chat template a builtin tokenizer gets when the run's task asks for one (chatTemplate: true): the turns
# (system, user) separated by <bos>, and <bos> again as the generation prompt, so a templated prompt is
# `<bos>SYSTEM<bos>PROMPT<bos>`: only special tokens besides the content, which any builtin alphabet allows.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if not loop.first %}{{ bos_token }}{% endif %}{{ m['content'] }}"
    "{% endfor %}{% if add_generation_prompt %}{{ bos_token }}{% endif %}"
)


@dataclass(frozen=True)
class Builtin:
    chars: str  # the tokenizer's characters, after the special tokens
    arch: dict = field(repr=False)  # Qwen2Config fields
    warm_start_steps: int
    label_noise: float  # fraction of warm-start demonstrations with a near-miss answer
    demonstration: str  # how a warm-start completion writes the answer


BUILTINS = {
    "tiny-arithmetic": Builtin(
        CHARS,
        {
            "hidden_size": 64,
            "intermediate_size": 192,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        warm_start_steps=1500,
        label_noise=0.5,
        demonstration="{answer}",
    ),
    # head size 96 / 3 = 32, the smallest vLLM's CPU attention supports, so examples/math runs on either engine
    "tiny-math": Builtin(
        MATH_CHARS,
        {
            "hidden_size": 96,
            "intermediate_size": 288,
            "num_hidden_layers": 3,
            "num_attention_heads": 3,
            "num_key_value_heads": 3,
        },
        warm_start_steps=2500,
        label_noise=0.4,
        demonstration="\\boxed{{{answer}}}",
    ),
}


def cache_root() -> Path:
    return Path(env.get(env.CACHE) or Path.home() / ".cache" / "rlfleet")


def publish(tmp: Path, dest: Path) -> None:
    """Move a finished model directory `tmp` (made by mkdtemp next to `dest`) to its cache entry `dest` in one
    rename, so that a concurrent reader sees no model or all of it. A node's model cache is shared: written by
    whoever ran first (root, a CI job), read by every pod's user, and mkdtemp and safetensors make owner-only
    files; a cached model is no secret. If another process renamed its copy first, ours is dropped by the caller's
    cleanup: both were made from the same content."""
    for p in [tmp, *tmp.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    try:
        os.rename(tmp, dest)
    except OSError:  # `dest` exists: another process finished first
        pass


def build_tokenizer(chars: str = CHARS):
    """Character-level tokenizer over `chars`: one token per character, `<bos>` prepended, `<eos>` ends completions."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *dict.fromkeys(chars)])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def _spec_key(name: str, task_spec, steps: int, seed: int) -> str:
    """Hash of everything a build depends on: the builtin's recipe (characters, architecture, label noise,
    demonstration), the task, the warm-start steps, the seed and the build code's version."""
    blob = json.dumps(
        {
            "name": name,
            "recipe": asdict(BUILTINS[name]),
            "task": _task_key(task_spec),
            "steps": steps,
            "seed": seed,
            "build": BUILD_VERSION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _task_key(task_spec) -> dict:
    """The task spec as hashed: its JSON, less the prompt fields at their defaults (chatTemplate false, no
    systemPrompt) and an empty `tools` (in a mixture's sources too), so that adding those fields kept the keys of
    every build made before them."""
    dump = task_spec.model_dump(mode="json")
    if not dump.get("chat_template", True):
        dump.pop("chat_template")
        if dump.get("system_prompt", "") is None:
            dump.pop("system_prompt")
    _drop_empty_tools(dump)
    return dump


def _drop_empty_tools(value) -> None:
    if isinstance(value, dict):
        if value.get("tools") == []:
            value.pop("tools")
        for inner in value.values():
            _drop_empty_tools(inner)
    elif isinstance(value, list):
        for inner in value:
            _drop_empty_tools(inner)


def wants_chat_template(task_spec) -> bool:
    from rlfleet.config import task_sources

    return any(single.chat_template for _, _, single in task_sources(task_spec))


def builtin_dir_name(model_spec, task_spec, seed: int = 0) -> str:
    """`NAME-KEY`: the cache (and shipped) directory name of a builtin model spec's build."""
    name = model_spec.path[len(BUILTIN_PREFIX) :]
    if name not in BUILTINS:
        raise ValueError(f"spec.model.path: unknown builtin model {name!r}; known: {sorted(BUILTINS)}")
    steps = model_spec.warm_start_steps or BUILTINS[name].warm_start_steps
    return f"{name}-{_spec_key(name, task_spec, steps, seed)}"


def cached_builtin(model_spec, task_spec, seed: int = 0) -> Path | None:
    """The HF directory of a builtin `model.path` if it is on this machine already (a cached or shipped
    build), else None; never builds."""
    dir_name = builtin_dir_name(model_spec, task_spec, seed)
    for candidate in (cache_root() / "builtin" / dir_name, SHIPPED / dir_name):
        if (candidate / "config.json").exists():
            return candidate
    return None


def resolve_builtin(model_spec, task_spec, seed: int = 0, progress: Callable[[int, int], None] | None = None) -> Path:
    """The HF directory of a builtin `model.path`: from the cache, else from the shipped builds, else built and
    cached (rlfleet/models/sources.py resolves every other source). `progress(done, total)` follows a build's
    warm-start steps (first called with done = 0, so a caller learns that a build starts)."""
    path = model_spec.path
    found = cached_builtin(model_spec, task_spec, seed)
    if found:
        return found
    name = path[len(BUILTIN_PREFIX) :]
    steps = model_spec.warm_start_steps or BUILTINS[name].warm_start_steps
    dest = cache_root() / "builtin" / builtin_dir_name(model_spec, task_spec, seed)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".build-"))
    try:
        build_builtin(name, task_spec, steps, seed, tmp, progress)
        publish(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def build_builtin(
    name: str, task_spec, steps: int, seed: int, dest: Path, progress: Callable[[int, int], None] | None = None
) -> None:
    """Initialize the model from `seed`, warm-start it on the task for `steps`, save to `dest`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlfleet.models.warm_start import WarmStart, supervised_warm_start
    from rlfleet.tasks import make_task

    builtin = BUILTINS[name]
    tokenizer = build_tokenizer(builtin.chars)
    if wants_chat_template(task_spec):
        tokenizer.chat_template = CHAT_TEMPLATE
    task = make_task(task_spec, isolate=False)  # the warm start draws ~10^5 problems: no process boundary per call
    check_coverage(name, builtin, task)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **builtin.arch,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU kernels may sum in another order with more threads; one keeps builds identical
    try:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        recipe = WarmStart(steps, seed, label_noise=builtin.label_noise, demonstration=builtin.demonstration)
        supervised_warm_start(model, tokenizer, task, recipe, progress=progress)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)


def check_coverage(name: str, builtin: Builtin, task) -> None:
    """Refuse a data set with a character the builtin tokenizer lacks (it would be read as padding).
    Generated tasks (arithmetic) have no rows to check; their characters are those of tiny-arithmetic."""
    if not hasattr(task, "ids"):
        return
    known = set(builtin.chars)
    for task_id in task.ids():
        p = task.problem(task_id)
        written = p.reference if p.reference is not None else builtin.demonstration.format(answer=p.answer)
        missing = sorted(set(p.prompt + (p.system_prompt or "") + written) - known)
        if missing:
            raise ValueError(
                f"spec.model.path: {BUILTIN_PREFIX}{name} knows only the characters {builtin.chars!r}; "
                f"task {task_id} (spec.task) has {''.join(missing)!r}. Use a data set written with "
                f"those characters (e.g. builtin://tiny-math) or a model directory of your own"
            )
