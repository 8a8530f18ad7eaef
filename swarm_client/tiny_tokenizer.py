"""The tiny models' tokenizer: a byte-level BPE trained here on a few built-in paragraphs, with ChatML special
tokens and a chat template with Qwen 2.5 (Hermes) tool calling, so tiny models (``tiny_model``) and tiny replicas
of real checkpoints (``model_likes``) round-trip any unicode text and serve the chat API end to end, offline.
"""

from __future__ import annotations

from typing import Any

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)

TOKENIZER_VOCAB_SIZE = 1536
MAX_POSITIONS = 2048

# ChatML with Qwen 2.5's (Hermes) tool calling: ``developer`` = ``system``; content parts joined; ``None``
# content renders empty; ``tools`` listed in the system turn, ``tool_calls`` written as ``<tool_call>``
# blocks (arguments with ``tojson``), consecutive ``tool`` results one user turn of ``<tool_response>``s.
CHAT_TEMPLATE = (
    "{%- macro text(message) -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] is none -%}"
    "{%- else -%}{{- message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -}}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set first = messages[0]['role'] if messages else '' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if first in ('system', 'developer') -%}{{- text(messages[0]) + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = 'system' if message['role'] == 'developer' else message['role'] -%}"
    "{%- if tools and loop.first and role == 'system' -%}"
    "{%- elif role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + text(message) + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif role == 'assistant' and message['tool_calls'] -%}"
    "{{- '<|im_start|>assistant' -}}"
    "{%- set content = text(message) -%}"
    "{%- if content -%}{{- '\\n' + content -}}{%- endif -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set call = call['function'] if call['function'] is defined else call -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name']"
    " + '\", \"arguments\": ' + (call['arguments'] if call['arguments'] is string else (call['arguments'] | tojson))"
    " + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + role + '\\n' + text(message) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Training text for the tokenizer: plain English prose, a dialogue, some code-ish and numeric lines, so common
# words and chat fragments become single tokens. Anything else still encodes, byte by byte.
CORPUS = """\
The swarm is a group of ordinary computers that work together to run a language model that none of
them could hold alone. Each server keeps a few consecutive blocks of the model in memory. A client
sends the hidden states of its tokens through a chain of servers, one span of blocks after another,
and reads the next token from the final layer. When a server leaves, the client finds another server
that holds the same blocks and continues where it stopped, so the answer is the same as if nothing
had happened.

Hello! How are you today? I am fine, thank you. What would you like to talk about? Let us talk about
the weather, the news, books, music, cooking, travel, science and history. Please tell me a short
story about a small robot who wanted to learn how to paint. Once upon a time there was a little
robot named Pip. Every morning Pip watched the sun rise over the hills and wished it could paint the
colors of the sky: red, orange, yellow, green, blue and violet. One day an old painter gave Pip a
brush and said, "Paint what you see, not what you think you see."

You are a helpful assistant. The user asks a question and the assistant answers it clearly and
politely. If the assistant does not know the answer, it says so. Answers should be short, correct
and kind. The system message sets the rules; the developer message adds instructions; the user
message is the request.

Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are there in a week? Answer: There are seven days in a week.
Question: What is 2 + 2? Answer: 2 + 2 = 4. And 12 * 12 = 144, 100 / 4 = 25, 3.14159 is close to pi.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024 2048 2024 2025 1999 2000.

def generate(prompt, max_tokens=16, temperature=0.7):
    tokens = tokenizer.encode(prompt)
    for step in range(max_tokens):
        logits = model(tokens)[-1]
        tokens.append(sample(logits, temperature))
    return tokenizer.decode(tokens)

{"model": "tiny", "messages": [{"role": "user", "content": "Say hello"}], "stream": true}

Water boils at one hundred degrees Celsius at sea level. The earth goes around the sun once a year,
and the moon goes around the earth about once a month. Plants need light, water and air to grow.
People have written stories, poems and songs for thousands of years, and they still do: in the
morning, in the evening, at home and at work. Good morning, good afternoon, good evening and good
night. Thanks, please, sorry, yes, no, maybe, of course.

A recipe for bread: mix flour, water, salt and yeast in a large bowl. Knead the dough for ten
minutes until it is smooth, then leave it somewhere warm for an hour so it can rise. Shape the loaf,
bake it in a hot oven for about forty minutes, and let it cool before cutting. Fresh bread smells
wonderful, and it tastes even better with butter.

Travel notes. We took the early train along the coast, past fishing villages, lighthouses and long
sandy beaches. In the afternoon it started raining, so we visited a small museum about ships, maps
and famous explorers. The next day the weather cleared; we walked through the old market, bought
cheese, apples and honey, and watched the boats return to the harbour while the evening light turned
golden over the water.

Science is a way of asking questions about the world and testing the answers. A good experiment
changes one thing at a time and measures what happens. Computers follow instructions called
programs; a program reads input, computes something, and writes output. Memory, storage, networks,
servers and clients are parts of every modern system. When many machines cooperate, they must agree
on messages, handle failures, and recover gracefully.

Why do cats sleep so much? Where should we go next summer? Which book would you recommend for a long
journey? Could you explain that again, more slowly? Sure! First, open the settings. Second, choose
your language. Third, press the green button. If anything goes wrong, restart the program and try
once more. Is everything clear now? Yes, thank you very much. You're welcome; I'm glad I could help.
Don't hesitate to ask if you'd like more help.
"""


# transformers 5.x forces ``Qwen2Tokenizer`` on every ``model_type == "qwen2"`` checkpoint, whatever
# ``tokenizer_config.json`` says, and that class rebuilds the pipeline: NFC normalizer + this split
# regex. The qwen2 tiny model is trained with the same pipeline, so what we build is what
# ``AutoTokenizer`` loads back.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def build_tokenizer(family: str = "llama") -> Any:
    """A byte-level BPE trained on ``CORPUS``, as a ``PreTrainedTokenizerFast`` with a ChatML template.

    GPT-2 style byte-level pre-tokenization and no normalizer, so any text (even non-NFC unicode)
    round-trips exactly; for ``qwen2`` the Qwen2 pipeline (NFC first) transformers imposes on that type.
    """
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    if family == "qwen2":
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so frequent words win merges; the trainer is deterministic for a fixed input.
    backend.train_from_iterator(CORPUS.splitlines(keepends=True) * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
        add_prefix_space=False,
    )
