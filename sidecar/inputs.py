"""A generate call's input made into token ids: a prompt, chat messages, token ids or a sequence to continue.

Apart from the engine so that the server can make a large input on another thread from the tokenizer and
the vocabulary's size alone: a thread holding the engine kept an unloaded model's memory for good.
"""

from __future__ import annotations

from numbers import Integral

from . import chat, sequences
from .errors import EmptyInput, InvalidArgument, TokenOutOfRange
from .sequences import Continuable
from .text import check_unicode


class InputIds(tuple):
    """Ids that `input_ids` made and checked, taken as they are when given back as `token_ids`: checking
    262,144 ids again took the server's main thread 160 ms (2-5 ms taken as they are; 10 ms now that plain
    ints are checked at C speed). Immutable, and never kept: a call's input is a list made from it."""


def input_ids(tokenizer, vocab_size: int, prompt=None, *, token_ids=None, messages=None, chat_template=None,
              add_generation_prompt=None, continue_final_message=False, tools=None, documents=None,
              chat_template_kwargs=None) -> list[int]:
    """The input as token ids, checked. Tokenizing a prompt of a megabyte takes a second (the fast tokenizers
    let go of the GIL meanwhile)."""
    if sum(x is not None for x in (prompt, token_ids, messages)) != 1:
        raise InvalidArgument("give exactly one of prompt, token_ids and messages", option="prompt")
    if messages is None and (chat_template is not None or add_generation_prompt is not None or continue_final_message
                             or tools is not None or documents is not None or chat_template_kwargs is not None):
        raise InvalidArgument("chat_template, add_generation_prompt, continue_final_message, tools, documents and "
                              "chat_template_kwargs go with messages", option="messages")
    if messages is not None:
        ids = chat.render(tokenizer, messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                          continue_final_message=continue_final_message, tools=tools, documents=documents,
                          chat_template_kwargs=chat_template_kwargs)
    elif isinstance(prompt, Continuable):
        ids = sequences.input_ids(tokenizer, prompt)
    elif prompt is not None:
        if not isinstance(prompt, str):
            hint = "; token ids go in token_ids=[...]" if hasattr(prompt, "tolist") or isinstance(prompt, (list, tuple)) else ""
            raise InvalidArgument(f"prompt must be a string, got {type(prompt).__name__}{hint}", option="prompt")
        check_unicode(prompt, "prompt")
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    elif isinstance(token_ids, InputIds) and token_ids:
        return list(token_ids)
    else:
        token_ids = vector_as_list(token_ids, "token_ids")
        if not isinstance(token_ids, (list, tuple)):
            dims = getattr(token_ids, "ndim", None)
            raise InvalidArgument(f"token_ids must be a list of integers, got {type(token_ids).__name__}"
                                  + (f" of {dims} dimensions: give one row" if isinstance(dims, int) else ""),
                                  option="token_ids")
        if set(map(type, token_ids)) <= {int}:  # the common case, checked without a Python step per id
            ids = list(token_ids)
        elif all(_is_int(t) for t in token_ids):  # numpy's and other integers
            ids = [int(t) for t in token_ids]
        else:
            raise InvalidArgument("token_ids must be a list of integers", option="token_ids")
    if not ids:
        raise EmptyInput("the input is empty: give at least one token")
    check_token_ids(ids, vocab_size)
    return ids


def check_token_ids(token_ids, vocab_size: int, what: str = "token ids") -> None:
    """Raises `TokenOutOfRange` naming the ids outside the vocabulary (the first five)."""
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return
    outside = [t for t in token_ids if not 0 <= t < vocab_size][:5]
    if outside:
        raise TokenOutOfRange(f"{what} {outside} are outside the vocabulary [0, {vocab_size})", token_ids=outside)


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def vector_as_list(value, option: str):
    """A torch or numpy vector as the list of its values (transformers users hold ids as tensors); anything
    else as it is. A tensor whose values cannot be read (on the meta device, sparse) is refused naming `option`."""
    if not (hasattr(value, "tolist") and getattr(value, "ndim", None) == 1):
        return value
    try:
        return value.tolist()
    except Exception as error:  # torch's meta and sparse tensors have no values to give
        raise InvalidArgument(f"{option} is a {type(value).__name__} whose values cannot be read ({str(error)[:100]}): "
                              "give a list of integers", option=option) from None
