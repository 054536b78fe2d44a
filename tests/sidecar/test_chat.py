"""Chat input: messages rendered by the tokenizer's own template, checked against transformers' rendering."""

import json
import shutil
import subprocess
import sys

import pytest

from protocol.peer import Peer
from sidecar import Engine, errors

CONVERSATION = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Where is the sidecar?"}]
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"

# A template that reads tools, documents, a content of parts, tool calls and a variable of its own, as tool-use
# and retrieval templates (Llama 3.1's, Qwen's, Command R's) and Qwen3's enable_thinking do
TOOLS_TEMPLATE = (
    "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}{% for d in documents or [] %}doc: {{ d['text'] }}\n{% endfor %}"
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% elif m['content'] %}"
    "{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{% if m['tool_calls'] %} calls {{ m['tool_calls'] | tojson }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and not enable_thinking %} (no thinking)"
    "{% endif %}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "where", "description": "Finds a thing",
                                           "parameters": {"type": "object", "properties": {"what": {"type": "string"}}}}}]
TOOL_CONVERSATION = [
    {"role": "user", "content": [{"type": "text", "text": "Where is "}, {"type": "text", "text": "the sidecar?"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "where",
                                                                                             "arguments": {"what": "sidecar"}}}]},
    {"role": "tool", "content": "beside the BEAM", "tool_call_id": "0"},
]
TOOL_OPTIONS = {"tools": TOOLS, "documents": [{"title": "a", "text": "Ports frame with 4 bytes."}],
                "chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def plain_dir(gpt2_dir, tmp_path_factory):
    """A model whose tokenizer ships no chat template."""
    path = tmp_path_factory.mktemp("plain") / "model"
    shutil.copytree(gpt2_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def plain_engine(plain_dir):
    return Engine.load(plain_dir)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def rendered(engine, messages, **options) -> list[int]:
    """transformers' own rendering: the reference."""
    return list(engine.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **options))


def test_messages_are_the_tokens_transformers_renders(engine):
    with engine.session() as session:
        chat = session.generate(messages=CONVERSATION, max_new_tokens=6, eos_token_ids=[])
    with engine.session() as session:
        plain = session.generate(token_ids=rendered(engine, CONVERSATION, add_generation_prompt=True), max_new_tokens=6,
                                 eos_token_ids=[])
    assert chat.token_ids == plain.token_ids and chat.stats.prompt_tokens == plain.stats.prompt_tokens


def test_continuing_the_final_message(engine):
    messages = CONVERSATION + [{"role": "assistant", "content": "It is"}]
    expected = rendered(engine, messages, continue_final_message=True)
    with engine.session() as session:
        result = session.generate(messages=messages, continue_final_message=True, max_new_tokens=2)
        assert session.history[: len(expected)] == expected
    assert result.stats.prompt_tokens == len(expected)


def test_each_turn_reuses_the_previous_turns_answer_included(engine, capsys):
    """Five turns, each sending the whole conversation: the cache covers everything it held before."""
    messages, rows = list(CONVERSATION), []
    with engine.session() as session:
        for turn in range(5):
            held = session.history[: session.cached]
            new_input = rendered(engine, messages, add_generation_prompt=True)
            result = session.generate(messages=messages, max_new_tokens=10)
            expected = min(common_prefix_length(held, new_input), len(new_input) - 1)
            assert result.stats.reused_tokens == expected
            rows.append((turn + 1, result.stats.prompt_tokens, result.stats.reused_tokens, len(held)))
            messages += [{"role": "assistant", "content": result.text}, {"role": "user", "content": f"And turn {turn + 2}?"}]
    for turn, prompt, reused, held in rows[1:]:
        assert reused == held, f"turn {turn} reused {reused} of the {held} tokens the session held"
    with capsys.disabled():
        print("\nturn  prompt  reused  held before")
        for row in rows:
            print("{:>4}  {:>6}  {:>6}  {:>11}".format(*row))


def test_tools_documents_parts_tool_calls_and_template_variables_render_as_transformers_renders_them(engine):
    """An assistant message calling tools has no content, and was refused (helper-69); tools, documents and a
    template's own variables had no way in."""
    expected = rendered(engine, TOOL_CONVERSATION, chat_template=TOOLS_TEMPLATE, add_generation_prompt=True,
                        tools=TOOLS, documents=TOOL_OPTIONS["documents"], enable_thinking=False)
    bare = rendered(engine, TOOL_CONVERSATION, chat_template=TOOLS_TEMPLATE, add_generation_prompt=True)
    assert len(expected) > len(bare) + 20  # the tools, the document and the variable are in it
    with engine.session() as session:
        result = session.generate(messages=TOOL_CONVERSATION, chat_template=TOOLS_TEMPLATE, max_new_tokens=2,
                                  **TOOL_OPTIONS)
        assert session.history[: len(expected)] == expected and result.stats.prompt_tokens == len(expected)


def test_a_model_without_a_template_needs_one(plain_engine):
    assert plain_engine.chat_templates == []
    with plain_engine.session() as session:
        with pytest.raises(errors.NoChatTemplate, match="no chat template"):
            session.generate(messages=CONVERSATION)
        result = session.generate(messages=CONVERSATION, chat_template=PLAIN_TEMPLATE, max_new_tokens=2)
    expected = rendered(plain_engine, CONVERSATION, chat_template=PLAIN_TEMPLATE, add_generation_prompt=True)
    assert result.stats.prompt_tokens == len(expected)


@pytest.mark.parametrize("options, option", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": "a\udcff"}]}, "messages"),
    ({"messages": CONVERSATION, "add_generation_prompt": True, "continue_final_message": True}, "add_generation_prompt"),
    ({"messages": CONVERSATION, "chat_template": "{% if true %}"}, "chat_template"),  # the template itself is wrong
    ({"messages": CONVERSATION, "chat_template": "{{ raise_exception('roles must alternate') }}"}, "messages"),
    ({"messages": CONVERSATION, "chat_template": 5}, "chat_template"),
    ({"prompt": "x", "messages": CONVERSATION}, "prompt"),
    ({"prompt": "x", "chat_template": "default"}, "messages"),
    ({"prompt": "x", "tools": TOOLS}, "messages"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages"),  # no tool_calls: no content is none
    ({"messages": [{"role": "user", "content": ["text"]}]}, "messages"),
    ({"messages": CONVERSATION, "tools": TOOLS[0]}, "tools"),
    ({"messages": CONVERSATION, "documents": [{"text": "a\udcff"}]}, "documents"),
    ({"messages": CONVERSATION, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ({"messages": CONVERSATION, "chat_template_kwargs": {1: True}}, "chat_template_kwargs"),
])
def test_bad_chat_input_is_a_typed_error_and_changes_nothing(engine, options, option):
    with engine.session() as session:
        session.generate(token_ids=[5, 6, 7], max_new_tokens=2)
        before = (list(session.history), session.cached)
        with pytest.raises(errors.InvalidArgument) as caught:
            session.generate(**options)
        assert caught.value.details["option"] == option
        assert (session.history, session.cached) == before


def test_a_template_that_is_no_template_says_whose_it_is(plain_engine):
    """(helper-86) A model directory's broken template was "chat_template is not a valid template", an option
    the call never gave."""
    with plain_engine.session() as session:
        with pytest.raises(errors.InvalidArgument, match="^the chat_template given is not a valid template"):
            session.generate(messages=CONVERSATION, chat_template="{% if true %}")
        plain_engine.tokenizer.chat_template = "{% if true %}"
        try:
            with pytest.raises(errors.InvalidArgument, match="^the model's chat template 'default' \\(from its "
                               "directory\\) is not a valid template") as caught:
                session.generate(messages=CONVERSATION)
        finally:
            plain_engine.tokenizer.chat_template = None
        assert caught.value.details["option"] == "chat_template"


def test_chat_over_the_protocol(default_dir, plain_dir, plain_engine, engine, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    server = [sys.executable, "-m", "sidecar", "--model", "default", "--log-level", "ERROR", "--model-root", str(plain_dir)]
    with Peer(server, stderr=subprocess.DEVNULL) as peer:
        assert peer.call("models")["result"]["models"][0]["chat_templates"] == ["default"]
        peer.call("open_session", session="c")
        reply = peer.call("generate", session="c", messages=CONVERSATION, max_new_tokens=3, eos_token_ids=[])
        assert len(reply["result"]["token_ids"]) == 3
        named = peer.call("generate", session="c", messages=CONVERSATION, chat_template="{{ messages }}")
        assert named["error"]["code"] == "invalid_argument" and named["error"]["option"] == "chat_template"
        peer.call("load_model", name="gpt2", path=str(plain_dir))
        peer.call("open_session", model="gpt2", session="g")
        assert peer.call("generate", session="g", messages=CONVERSATION)["error"]["code"] == "no_chat_template"
    template.write_text(TOOLS_TEMPLATE)
    with Peer([sys.executable, "-m", "sidecar", "--model", str(plain_dir), "--chat-template", str(template),
               "--log-level", "ERROR"], stderr=subprocess.DEVNULL) as peer:
        peer.call("open_session", session="g")
        reply = peer.call("generate", session="g", messages=CONVERSATION, max_new_tokens=2)
        assert reply["ok"], reply
        expected = rendered(plain_engine, CONVERSATION, chat_template=TOOLS_TEMPLATE, add_generation_prompt=True)
        assert reply["result"]["stats"]["prompt_tokens"] == len(expected)
        tools = peer.call("generate", session="g", messages=TOOL_CONVERSATION, max_new_tokens=2, **TOOL_OPTIONS)
        assert tools["result"]["stats"]["prompt_tokens"] == len(rendered(
            plain_engine, TOOL_CONVERSATION, chat_template=TOOLS_TEMPLATE, add_generation_prompt=True, tools=TOOLS,
            documents=TOOL_OPTIONS["documents"], enable_thinking=False)), tools
        # the operator's template belongs to the directory: a new load of it after an unload keeps it
        assert peer.call("unload_model", model="default")["ok"]
        assert peer.call("load_model", name="again", path=str(plain_dir))["ok"]
        peer.call("open_session", model="again", session="h")
        reply = peer.call("generate", session="h", messages=CONVERSATION, max_new_tokens=2)
        assert reply["ok"] and reply["result"]["stats"]["prompt_tokens"] == len(expected), reply
        # and no other directory gets it: the embedded model keeps its own
        assert peer.call("load_model", name="embedded")["ok"]
        peer.call("open_session", model="embedded", session="e")
        reply = peer.call("generate", session="e", messages=CONVERSATION, max_new_tokens=2, eos_token_ids=[])
        assert reply["result"]["stats"]["prompt_tokens"] == len(rendered(engine, CONVERSATION, add_generation_prompt=True))
