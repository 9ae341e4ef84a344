"""A chat about one long document, rendered to token ids with the model's chat template.

The document sits at the start of the first user message, so its tokens form a prefix that
stays the same for every later question: a follow-up prefills only the new turns. It is
tokenized once (it can be 1M tokens); the template around it is rendered with a placeholder
and only the small pieces around the placeholder are tokenized per turn.

Documents and messages are plain text: a special-token string in them ("<|im_end|>") encodes
as its characters, so text a user loads or types cannot close a turn or open a system one;
only the template's own markers become control tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .tokenizer import Tokenizer

_PLACEHOLDER = "\u0000kvchat-document\u0000"
_PENDING_QUESTION = "\u0000kvchat-question\u0000"


@dataclass
class Conversation:
    system: str | None = None
    document_ids: list[int] = field(default_factory=list)
    document_name: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)  # user/assistant turns
    # A system text that follows the document, at the head of the first user message: a
    # server's client's own system message, kept out of the prefix every request shares.
    after_document: str | None = None

    @property
    def has_document(self) -> bool:
        return bool(self.document_ids)

    def _template_messages(
        self, tokenizer: Tokenizer, pending_question: str | None
    ) -> list[dict[str, str]]:
        """The turns to render, their texts shielded (typed, quoted or replied text never
        becomes a control token); the question is shielded unless it is kvchat's own slot."""
        turns = [{**m, "content": tokenizer.shield(m["content"])} for m in self.messages]
        if pending_question == _PENDING_QUESTION:
            turns.append({"role": "user", "content": pending_question})
        elif pending_question is not None:
            turns.append({"role": "user", "content": tokenizer.shield(pending_question)})
        if self.document_ids and turns:
            first = turns[0]
            lead = f"{tokenizer.shield(self.after_document)}\n\n" if self.after_document else ""
            turns[0] = {
                "role": first["role"],
                "content": f"{_PLACEHOLDER}\n\n{lead}{first['content']}",
            }
        system = (
            [{"role": "system", "content": tokenizer.shield(self.system)}] if self.system else []
        )
        return system + turns

    def prompt_ids(self, tokenizer: Tokenizer, question: str) -> list[int]:
        """Ids of the whole history plus `question` as a new user turn, ready for the reply."""
        text = tokenizer.chat_text(
            self._template_messages(tokenizer, question), add_generation_prompt=True
        )
        return self._encode_around_document(tokenizer, text)

    def document_prefix_ids(self, tokenizer: Tokenizer) -> list[int]:
        """Ids up to the end of the document: what can be prefilled before any question."""
        if not self.document_ids or self.messages:
            raise ValueError("a document prefix exists only before the first question")
        text = tokenizer.chat_text(
            self._template_messages(tokenizer, _PENDING_QUESTION), add_generation_prompt=False
        )
        return self._encode_around_document(
            tokenizer, text[: text.index(_PLACEHOLDER) + len(_PLACEHOLDER)]
        )

    def document_prefix_length(self, tokenizer: Tokenizer) -> int:
        """Tokens of the template before the document's first token."""
        text = tokenizer.chat_text(
            self._template_messages(tokenizer, _PENDING_QUESTION), add_generation_prompt=False
        )
        return len(tokenizer.encode_chat(text[: text.index(_PLACEHOLDER)]))

    def _encode_around_document(self, tokenizer: Tokenizer, text: str) -> list[int]:
        if not self.document_ids:
            return tokenizer.encode_chat(text)
        before, after = text.split(_PLACEHOLDER, 1)
        return tokenizer.encode_chat(before) + self.document_ids + tokenizer.encode_chat(after)

    def add_turn(self, question: str, answer: str) -> None:
        self.messages += turn_messages(question, answer)


def turn_messages(question: str, answer: str) -> list[dict[str, str]]:
    """One turn as chat messages: the user's question, then the assistant's answer."""
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
