"""trainer.lora: train low-rank adapters (PEFT LoRA) over a frozen base; every policy version is the adapter.

`attach` injects PEFT's LoRA layers into the loaded causal LM in place (`get_peft_model`): each targeted
linear layer computes W0 x + s B A x (s = alpha / rank, dropout 0 so the trainer scores exactly what a merged
model computes), with B initialised to zero, so version 0 is the base exactly. The base weights are frozen
(requires_grad off); `Adapters.parameters` are the only ones the optimizer holds. The model object stays the
one the loss and the state code already use (its forward is the adapted one), so only the optimizer's
parameters and the publish step differ from full fine-tuning.

Publishing: `Adapters.save` writes PEFT's adapter_config.json and adapter_model.safetensors from the step's
gathered trainable parameters (the lora_A/lora_B tensors: the trainer gathers no part of the frozen base), and
`section` is the manifest's `adapter` section naming the base by its identity (rlfleet/versions/adapter.py), so
workers and the verifier refuse it over any other base. Adapters ship whole, never as deltas
(rlfleet/versions/publish.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlfleet.versions.adapter import ADAPTER_FILES, adapter_section
from rlfleet.versions.manifest import AdapterSection

PEFT_PREFIX = "base_model.model."  # what PeftModel's state dict adds before the wrapped model's names


class Adapters:
    def __init__(self, peft_model, section: AdapterSection):
        self.peft_model, self.section = peft_model, section

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.peft_model.parameters() if p.requires_grad]

    def save(self, model_state: dict, dest: Path) -> None:
        """Write the adapter of `model_state` (a state dict of the adapted model: its trainable part, as the trainer
        gathers it, or the whole) into `dest`: exactly ADAPTER_FILES."""
        dest = Path(dest)
        state = {PEFT_PREFIX + k: v.detach().cpu().contiguous() for k, v in model_state.items() if ".lora_" in k}
        self.peft_model.save_pretrained(str(dest), state_dict=state, safe_serialization=True)
        for path in dest.iterdir():  # PEFT adds a model card (README.md); a version is the adapter alone
            if path.name not in ADAPTER_FILES:
                path.unlink()


def attach(model, spec, base_dir: Path, model_path: str) -> Adapters | None:
    """LoRA layers injected into `model` per `spec` (trainer.lora; None: full fine-tuning, returns None). `base_dir`
    is the base's directory (identified in every version's manifest), `model_path` the run's spec.model.path."""
    if spec is None:
        return None
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.target_modules), lora_dropout=0.0, bias="none"
    )
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    missing = sorted(set(spec.target_modules) - set(linear))
    if missing:
        raise ValueError(
            f"spec.trainer.lora.targetModules: {missing} name no linear layer of {model_path}; its linear layers are "
            f"{linear}"
        )
    peft_model = get_peft_model(model, config)  # injects into `model` itself and freezes its weights
    return Adapters(peft_model, adapter_section(base_dir, model_path))
