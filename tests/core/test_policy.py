"""Loading a policy directory: the tokenizer a run uses is the one the model was built with."""

from rlfleet.models.builtin import build_tokenizer
from rlfleet.models.policy import load_policy
from tests.support import tiny_policy_dir


def test_a_saved_builtin_tokenizer_encodes_like_the_one_built_in_code(tmp_path):
    # A qwen2 config beside a character-level tokenizer: AutoTokenizer would pick Qwen2Tokenizer by
    # model_type and drop the spaces of "12 + 7 =", so the run's prompts would differ from the warm start's.
    policy_dir = tiny_policy_dir(tmp_path / "policy", seed=0)
    _, loaded = load_policy(policy_dir)
    built = build_tokenizer()
    for text in ["12 + 7 =", " 3 - 19 = -16", "0=0"]:
        assert loaded(text)["input_ids"] == built(text)["input_ids"], text
        assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == text
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (
        built.bos_token_id,
        built.eos_token_id,
        built.pad_token_id,
    )


def test_a_version_loaded_like_another_is_the_version_and_leaves_the_other_untouched(tmp_path):
    # The verifier loads each new version as a copy of the last one with the new weights (load_version's `like`):
    # it must equal loading from scratch, and the model it was copied from must keep its own weights.
    import json

    import torch

    from rlfleet.models.adapter import load_version, version_signature
    from rlfleet.versions.manifest import COMPLETE_MARKER

    def no_base():
        raise AssertionError("a whole-weights version never resolves the base")

    first, second = tiny_policy_dir(tmp_path / "v1", seed=1), tiny_policy_dir(tmp_path / "v2", seed=2)
    # As fetched: each holds its manifest and the fetcher's marker, which names the manifest's size.
    for version, size in ((first, 1906), (second, 1907)):
        (version / "manifest.json").write_text(json.dumps({"version": size}))
        (version / COMPLETE_MARKER).write_text(f"{size} bytes of manifest, every file verified\n")
    model1, tok1 = load_version(first, "float32", "cpu", no_base)
    before = {k: v.clone() for k, v in model1.state_dict().items()}
    like = (model1, tok1, version_signature(first))
    assert version_signature(second) == like[2]

    model2, tok2 = load_version(second, "float32", "cpu", no_base, like)
    scratch, _ = load_policy(second)
    assert model2 is not model1 and tok2 is tok1
    for name, tensor in scratch.state_dict().items():
        assert torch.equal(model2.state_dict()[name], tensor), name
    assert any(not torch.equal(before[k], model2.state_dict()[k]) for k in before)  # the seeds differ
    for name, tensor in model1.state_dict().items():
        assert torch.equal(before[name], tensor), name

    # Another config (here one more position) is loaded from scratch, not into a copy of the other shape.
    config = json.loads((second / "config.json").read_text())
    config["max_position_embeddings"] = 128
    (second / "config.json").write_text(json.dumps(config))
    assert version_signature(second) != like[2]
    model3, _ = load_version(second, "float32", "cpu", no_base, like)
    assert model3.config.max_position_embeddings == 128
