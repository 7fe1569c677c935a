"""Chat templates, a three-turn conversation and a small BPE tokenizer for the data tests (no downloads)."""
from __future__ import annotations

# Qwen2.5-style ChatML: a default system turn, no {% generation %} markers (like the real one).
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] != 'system' or not loop.first -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# The same template with HF generation markers around each assistant turn's content + <|im_end|>.
QWEN_TEMPLATE_MARKED = QWEN_TEMPLATE.replace(
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}",
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}{% generation %}{{- message['content'] + '<|im_end|>' -}}{% endgeneration %}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}",
)

# Llama-3 style: different headers and end-of-turn token, no markers.
LLAMA_TEMPLATE = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

# Thinking switch as Qwen3 has it: an empty think block in the generation prompt unless enabled.
THINKING_TEMPLATE = QWEN_TEMPLATE.replace(
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}",
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "What is the capital of France? Paris is the capital of France.",
    "Tell me a joke about cats. Why did the cat sit on the computer? To keep an eye on the mouse!",
    "Count from one to ten: one two three four five six seven eight nine ten.",
] * 4

THREE_TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "Tell me a joke about cats."},
    {"role": "assistant", "content": "Why did the cat sit on the computer? To keep an eye on the mouse!"},
    {"role": "user", "content": "Count from one to ten."},
    {"role": "assistant", "content": "one two three four five six seven eight nine ten"},
]


def bpe_tokenizer(template: str, eos: str = "<|im_end|>"):
    """A small byte-level BPE tokenizer (merges cross word boundaries like real ones do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|endoftext|>", eos_token=eos,
                                  additional_special_tokens=specials[1:])
    tok.chat_template = template
    return tok
