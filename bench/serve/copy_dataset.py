"""The copy dataset: requests whose answer repeats much of a document given in the prompt.

This is the workload where speculative decoding from the prompt (n-gram / prompt-lookup drafts)
pays: a summary quotes the document, key points are quoted from it, a quoted answer is copied
out of it, a formal rewrite keeps most of its words. The documents are ShareGPT answers (real
prose, code and lists, the same file as the sharegpt dataset); each request puts one document
under one of a few instructions, the instructions dealt in turn so that any run mixes them.

A document is kept when it has at least MIN_DOCUMENT_CHARS characters and the whole prompt fits
--copy-input-len tokens (and, with --max-model-len, prompt plus --copy-output-len fits it).
max_tokens is --copy-output-len for every request: without --ignore-eos a summary ends sooner
than a rewrite, which is the mix a server sees. The seed alone picks the documents, so a seed
gives the same prompts, in the same order, every time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nori.bench.serve.prompts import PromptMaker
from nori.bench.serve.sharegpt import read_exchanges
from nori.bench.serve.specs import RequestSpec

# Shorter answers ("Sure!", one line of code) leave nothing to copy from.
MIN_DOCUMENT_CHARS = 200
# The human turn becomes the quoted-answer template's question when it is a question this short.
MAX_QUESTION_CHARS = 300
_FALLBACK_QUESTION = "What is the main point of the document?"


@dataclass(frozen=True)
class CopyTemplate:
    """An instruction around a document; `text` has {document} and, optionally, {question}."""

    name: str
    text: str

    def prompt(self, document: str, question: str) -> str:
        return self.text.format(document=document, question=question)


TEMPLATES = (
    CopyTemplate(
        "summarise",
        "Summarise the following document in a few sentences, reusing its own wording where "
        "you can.\n\nDocument:\n{document}\n\nSummary:",
    ),
    CopyTemplate(
        "key-points",
        "List the key points of the following document as bullet points. Each point must "
        "quote the document word for word.\n\nDocument:\n{document}\n\nKey points:",
    ),
    CopyTemplate(
        "quote-answer",
        "Read the document, then answer the question by quoting the sentences of the document "
        "that answer it, word for word.\n\nDocument:\n{document}\n\nQuestion: {question}\n\n"
        "Answer:",
    ),
    CopyTemplate(
        "formal-rewrite",
        "Rewrite the following document in a more formal style. Keep its content, structure and "
        "any code unchanged.\n\nDocument:\n{document}\n\nFormal version:",
    ),
)


def question_for(human_turn: str) -> str:
    """The conversation's own question when it is a short one, else a generic one."""
    question = " ".join(human_turn.split())
    if 0 < len(question) <= MAX_QUESTION_CHARS:
        return question
    return _FALLBACK_QUESTION


def copy_requests(
    path: str | Path,
    maker: PromptMaker,
    rng: np.random.Generator,
    count: int,
    input_len: int,
    output_len: int,
    max_model_len: int | None = None,
) -> list[RequestSpec]:
    """`count` requests over a seeded shuffle of the file's answers, the templates in turn; the
    kept ones are repeated in turn when the file has fewer (as the sharegpt dataset does)."""
    exchanges = read_exchanges(path)
    longest = input_len if max_model_len is None else min(input_len, max_model_len - output_len)
    chosen: list[RequestSpec] = []
    # Tokenizes lazily, in shuffled order, only until enough requests are kept.
    for position in rng.permutation(len(exchanges)):
        human_turn, answer = exchanges[int(position)]
        document = answer.strip()
        if len(document) < MIN_DOCUMENT_CHARS:
            continue
        template = TEMPLATES[len(chosen) % len(TEMPLATES)]
        prompt = maker.from_text(template.prompt(document, question_for(human_turn)))
        if prompt.length <= longest:
            chosen.append(RequestSpec(prompt.value, prompt.length, output_len, "copy"))
            if len(chosen) == count:
                break
    if not chosen:
        raise ValueError(
            f"no answer in {path} of {MIN_DOCUMENT_CHARS}+ characters makes a prompt of at "
            f"most {longest} tokens (--copy-input-len, --max-model-len)"
        )
    return [chosen[index % len(chosen)] for index in range(count)]
