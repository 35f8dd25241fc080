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
