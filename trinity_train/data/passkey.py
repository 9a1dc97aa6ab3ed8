"""Passkey retrieval prompts (Mohtashami & Jaggi, 2023): a 5-digit key hidden at a depth in
repeated filler text, and the question that asks for it, tokenized by the run's tokenizer.

A prompt of `length` tokens is the model's input; the `length + 1` tokens of `PasskeyPrompt.tokens`
are that input and the key's last token, so the labels of the key's tokens (each predicted from the
tokens before it) all lie inside the input. Every piece is tokenized on its own and the ids joined,
so the key's tokens are the same in the needle and in the answer. Everything is a function of the
tokenizer, the length, the depth and the key's number: the same prompts at every validation.

Two templates (`eval.passkey_template`) pose the same task: "prose", Mohtashami & Jaggi's
English, and "code", a Python module with the key assigned in it and asked for at its end, for
models trained on code (the embedded default corpus is the Python standard library's source,
where English prose is rare). Both end the question with the needle's own words before the key
("The pass key is", "PASS_KEY ="), so a model that copies what followed them finds it.

Each prompt has a control: the same prompt and the same key scored, but another key hidden in the
needle. A model that does not read the needle scores the key alike in both (its guess at digits
after "is" or "="); one that reads it scores the key higher in its own prompt and lower in the
control, where the needle points elsewhere: the difference, the gain, says whether and how much
the needle is read.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from trinity_train.errors import ConfigError

@dataclass(frozen=True)
class PasskeyTemplate:
    intro: str
    filler: str  # repeated (and cut) to fill the prompt
    needle: str  # holds {key}
    question: str
    answer: str  # holds {key}: the tokens scored


TEMPLATES = {
    "prose": PasskeyTemplate(
        intro=("There is an important piece of information hidden inside a lot of irrelevant text. "
               "Find it and memorize it. I will quiz you about it."),
        filler=" The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
        needle=" The pass key is {key}. Remember it. {key} is the pass key.",
        question=" What is the pass key? The pass key is",
        answer=" {key}"),
    "code": PasskeyTemplate(
        intro='"""A module with a pass key hidden in it. Find it and remember it: the end asks for it."""\n',
        filler='\nprint("The grass is green.")\nprint("The sky is blue.")\n',  # no "=" but the needle's
        needle="\nPASS_KEY = {key}\n",
        question="\n\n# What is the pass key?\nPASS_KEY =",
        answer=" {key}"),
}


@dataclass(frozen=True)
class PasskeyPrompt:
    length: int  # input tokens
    depth: float  # where the needle starts, as a fraction of the filler
    key: str  # the 5 digits
    tokens: list[int]  # length + 1 ids: the input, then the key's last token
    needle_start: int  # index of the needle's first token
    answer_start: int  # index of the answer's first token (the key after the question)

    @property
    def answer_tokens(self) -> list[int]:
        return self.tokens[self.answer_start:]


def passkey_key(length: int, depth: float, number: int) -> str:
    """The 5-digit key of one prompt, fixed by its length, depth and number (a string seed:
    the same in every process and Python version)."""
    return str(random.Random(f"passkey-{length}-{depth}-{number}").randint(10000, 99999))


def passkey_prompt(encode: Callable[[str], list[int]], length: int, depth: float, key: str,
                   template: str = "prose", hidden: str | None = None) -> PasskeyPrompt:
    """The prompt of `length` input tokens with `key` at `depth` of its filler (`TEMPLATES`), or,
    given `hidden`, the control that hides that other key and still scores `key`."""
    words = TEMPLATES[template]
    intro, needle = encode(words.intro), encode(words.needle.format(key=hidden or key))
    question, answer = encode(words.question), encode(words.answer.format(key=key))
    filler_tokens = length + 1 - len(intro) - len(needle) - len(question) - len(answer)
    if filler_tokens < 0:
        raise ConfigError(f"eval.passkey_lengths: {length} tokens cannot hold the passkey prompt, which needs "
                          f"{length - filler_tokens} with this tokenizer; use longer lengths")
    unit = encode(words.filler)
    filler = (unit * (filler_tokens // len(unit) + 1))[:filler_tokens]
    before = round(depth * filler_tokens)
    tokens = intro + filler[:before] + needle + filler[before:] + question + answer
    return PasskeyPrompt(length, depth, key, tokens, needle_start=len(intro) + before,
                         answer_start=len(tokens) - len(answer))


def other_key(length: int, depth: float, number: int, keys: int) -> str:
    """A key that is not prompt `number`'s: the one its control prompt hides instead (drawn past
    the `keys` numbers the probe uses, so no prompt of the probe hides it)."""
    key, other = passkey_key(length, depth, number), number + keys
    while (hidden := passkey_key(length, depth, other)) == key:
        other += keys
    return hidden


def passkey_prompts(encode: Callable[[str], list[int]], lengths: list[int], depths: list[float],
                    keys: int, template: str = "prose", controls: bool = False) -> dict[int, list[PasskeyPrompt]]:
    """`keys` prompts per depth at each length, by length (in the order given); with `controls`,
    each one's control instead: the same key asked for and scored, another key hidden."""
    return {length: [passkey_prompt(encode, length, depth, passkey_key(length, depth, k), template,
                                    hidden=other_key(length, depth, k, keys) if controls else None)
                     for depth in depths for k in range(keys)] for length in lengths}
