"""Generator: a thin actor holding the target model for `app.regenerate` (logic in app/data/regenerate.py)."""
from __future__ import annotations


class Generator:
    """One target model replica that regenerates assistant turns of chunks of conversations."""

    def __init__(self, model_dir: str, dtype: str, device: str, num_cpus: float) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from app.devices import compute_dtype, limit_threads, pick_device

        limit_threads(num_cpus)
        self.device = pick_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        dt = compute_dtype(dtype, self.device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).to(self.device).eval()
        self.model.requires_grad_(False)

    def regenerate(self, chunk: list[tuple[int, list[dict]]], *, max_new_tokens: int, max_length: int,
                   batch_size: int, enable_thinking: bool) -> list[tuple[int, list[dict]]]:
        """(id, regenerated messages) for each (id, messages) of the chunk."""
        from app.data.regenerate import regenerate_conversations

        convs = regenerate_conversations(
            self.model, self.tokenizer, [m for _, m in chunk], max_new_tokens=max_new_tokens,
            max_length=max_length, batch_size=batch_size, device=str(self.device), enable_thinking=enable_thinking,
        )
        return [(rec_id, msgs) for (rec_id, _), msgs in zip(chunk, convs)]
