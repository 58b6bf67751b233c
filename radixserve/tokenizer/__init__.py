"""Tokenizer-side logic shared by the tokenizer process and the in-process Engine:
prompt normalisation (text, token ids, chat messages, within the input limits of
``TokenizerConfig``), incremental UTF-8-safe detokenization, and stop strings."""

from radixserve.tokenizer.detokenizer import IncrementalDetokenizer
from radixserve.tokenizer.inputs import InputProcessor
from radixserve.tokenizer.stop import StopStringMatcher

__all__ = ["IncrementalDetokenizer", "InputProcessor", "StopStringMatcher"]
