"""Chat input: a list of messages rendered into token ids by the tokenizer's own chat template.

Rendering is transformers' `apply_chat_template`, so a conversation gives exactly the tokens it gives
in transformers. A session then reuses its cache as for any other input: sending the whole
conversation each turn recomputes only what the last turn added, as far as the re-rendered earlier
turns (the previous answer included) tokenize to what the session holds.
"""

from __future__ import annotations

from jinja2 import TemplateSyntaxError

from .errors import InvalidArgument, NoChatTemplate
from .text import check_unicode

DEFAULT = "default"  # the name a tokenizer's single (unnamed) template goes by


def template_names(tokenizer) -> list[str]:
    """The names of the chat templates a tokenizer ships: [] for none, ["default"] for a single one."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return []
    return sorted(template) if isinstance(template, dict) else [DEFAULT]


def check_messages(messages) -> list[dict]:
    """A non-empty list of maps, each with a string `role` and a `content` that is a string, a list of content
    parts (maps: `{"type": "text", "text": ...}`), or nil or absent in a message with `tool_calls` (an
    assistant's call of tools, as OpenAI's API and transformers' templates write it)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidArgument("messages must be a non-empty list of {role, content} maps", option="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidArgument(f"messages[{i}] must be a map with a string role", option="messages", index=i)
        content = message.get("content")
        calls = message.get("tool_calls")
        if not (isinstance(content, str)
                or (isinstance(content, list) and all(isinstance(part, dict) for part in content))
                or (content is None and isinstance(calls, list) and calls)):
            raise InvalidArgument(f"messages[{i}].content must be a string or a list of content parts (maps), or "
                                  "left out with tool_calls", option="messages", index=i)
        _check_text(message, "messages", f"messages[{i}]", index=i)
    return list(messages)


def check_template_inputs(tools, documents, template_kwargs) -> dict:
    """The keyword arguments `apply_chat_template` takes beside the messages: `tools` (function schemas) and
    `documents` (for retrieval templates), lists of maps, and the template's own variables (Qwen3's
    `enable_thinking`), which may not be one of `apply_chat_template`'s own arguments."""
    given = {}
    for name, value in (("tools", tools), ("documents", documents)):
        if value is None:
            continue
        if not isinstance(value, (list, tuple)) or not all(isinstance(item, dict) for item in value):
            raise InvalidArgument(f"{name} must be a list of maps", option=name)
        _check_text(list(value), name, name)
        given[name] = list(value)
    if template_kwargs is not None:
        if not isinstance(template_kwargs, dict) or not all(isinstance(key, str) for key in template_kwargs):
            raise InvalidArgument("chat_template_kwargs must be a map with string keys", option="chat_template_kwargs")
        taken = sorted(set(template_kwargs) & RESERVED)
        if taken:
            raise InvalidArgument(f"chat_template_kwargs may not set {taken[0]!r}, an argument of the rendering itself",
                                  option="chat_template_kwargs")
        _check_text(template_kwargs, "chat_template_kwargs", "chat_template_kwargs")
        given.update(template_kwargs)
    return given


# apply_chat_template's own arguments, and the template's conversation
RESERVED = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
            "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
            "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


def _check_text(value, option: str, where: str, **detail) -> None:
    """Every string in `value` (keys included) is valid Unicode (see `check_unicode`); maps and lists are walked
    without recursion."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            check_unicode(item, option, f"{where} (a string in it)", **detail)
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)


def render(tokenizer, messages, *, chat_template=None, add_generation_prompt=None,
           continue_final_message: bool = False, tools=None, documents=None, chat_template_kwargs=None) -> list[int]:
    """The token ids of a conversation, ready for the model to write the next assistant turn.

    `chat_template`: a template name (see `template_names`) or, from Python, a template's own text.
    `add_generation_prompt` defaults to true unless `continue_final_message` asks to extend the last
    message instead (the two exclude each other, as in transformers). `tools`, `documents` and
    `chat_template_kwargs` go to the template as `apply_chat_template` passes them (`check_template_inputs`).
    """
    messages = check_messages(messages)
    extra = check_template_inputs(tools, documents, chat_template_kwargs)
    if not isinstance(continue_final_message, bool):
        raise InvalidArgument("continue_final_message must be true or false", option="continue_final_message")
    if add_generation_prompt is None:
        add_generation_prompt = not continue_final_message
    if not isinstance(add_generation_prompt, bool):
        raise InvalidArgument("add_generation_prompt must be true, false or null", option="add_generation_prompt")
    if add_generation_prompt and continue_final_message:
        raise InvalidArgument("add_generation_prompt and continue_final_message exclude each other: the first "
                              "starts a new assistant turn, the second extends the last message", option="add_generation_prompt")
    names = template_names(tokenizer)
    if chat_template is not None and not isinstance(chat_template, str):
        raise InvalidArgument("chat_template must be a template name or a template", option="chat_template")
    if chat_template is not None and chat_template not in names and not _is_template(chat_template):
        raise InvalidArgument(f"chat_template {chat_template[:60]!r} is neither a template name of this model "
                              f"(known: {', '.join(names) or 'none'}) nor a template (no {{{{ }}}} or {{% %}} in it)",
                              option="chat_template")
    if chat_template is None and not names:
        raise NoChatTemplate("the model's tokenizer has no chat template: send a prompt or token_ids, or give it "
                             "one: a chat_template.jinja in the model's directory; from Python, chat_template with "
                             "the template's text; for a server's startup model, --chat-template")
    if chat_template == DEFAULT and names == [DEFAULT]:
        chat_template = None
    try:
        ids = tokenizer.apply_chat_template(
            messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=True, return_dict=False, **extra)
    except TemplateSyntaxError as error:  # the template itself, whatever the messages
        whose = (f"the model's chat template {chat_template or (names[0] if len(names) == 1 else DEFAULT)!r} (from its "
                 "directory)" if chat_template is None or chat_template in names else "the chat_template given")
        raise InvalidArgument(f"{whose} is not a valid template: {str(error)[:300]}", option="chat_template") from error
    except Exception as error:  # jinja2's TemplateError (raise_exception in a template), ValueError, ...
        raise InvalidArgument(f"the chat template refused the messages: {type(error).__name__}: {str(error)[:300]}",
                              option="messages") from error
    return list(ids)


def check_template(tokenizer) -> None:
    """Raises `ValueError` when the tokenizer's own chat template is not a valid template (found by
    rendering a one-message conversation; a template that refuses that conversation may still be valid)."""
    try:
        render(tokenizer, [{"role": "user", "content": "Hello"}])
    except InvalidArgument as error:
        if error.details.get("option") == "chat_template":
            raise ValueError(error.message) from None


def _is_template(text: str) -> bool:
    """Whether a chat_template holds Jinja markup: text without any is a mistyped name, not a template."""
    return "{{" in text or "{%" in text
