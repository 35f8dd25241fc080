"""podTemplate overrides merge like Kubernetes' strategic merge patch for the lists a pod has."""

from __future__ import annotations

from rlfleet.operator.overrides import merge

BUILT = {
    "metadata": {"labels": {"a": "1"}},
    "spec": {
        "containers": [{"name": "main", "image": "i", "env": [{"name": "X", "value": "1"}], "args": ["--a"]}],
        "volumes": [{"name": "cache", "emptyDir": {}}],
        "tolerations": [{"key": "k"}],
        "securityContext": {"runAsNonRoot": True},
    },
}


def test_named_lists_merge_by_key_other_lists_replace_and_null_removes():
    out = merge(
        BUILT,
        {
            "metadata": {"labels": {"b": "2"}},
            "spec": {
                "containers": [
                    {
                        "name": "main",
                        "env": [{"name": "X", "value": "2"}, {"name": "Y", "value": "3"}],
                        "args": ["--b"],
                    },
                    {"name": "side", "image": "s"},
                ],
                "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
                "tolerations": [{"key": "other"}],
                "securityContext": None,
            },
        },
    )
    main, side = out["spec"]["containers"]
    assert main["image"] == "i" and main["env"] == [{"name": "X", "value": "2"}, {"name": "Y", "value": "3"}]
    assert main["args"] == ["--b"] and side == {"name": "side", "image": "s"}
    assert [v["name"] for v in out["spec"]["volumes"]] == ["cache", "shm"]
    assert out["spec"]["tolerations"] == [{"key": "other"}] and "securityContext" not in out["spec"]
    assert out["metadata"]["labels"] == {"a": "1", "b": "2"}
    assert BUILT["spec"]["containers"][0]["args"] == ["--a"], "the built template is not changed"
