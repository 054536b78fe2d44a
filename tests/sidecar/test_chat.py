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
])
def test_bad_chat_input_is_a_typed_error_and_changes_nothing(engine, options, option):
    with engine.session() as session:
        session.generate(token_ids=[5, 6, 7], max_new_tokens=2)
        before = (list(session.history), session.cached)
        with pytest.raises(errors.InvalidArgument) as caught:
            session.generate(**options)
        assert caught.value.details["option"] == option
        assert (session.history, session.cached) == before


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
    with Peer([sys.executable, "-m", "sidecar", "--model", str(plain_dir), "--chat-template", str(template),
               "--log-level", "ERROR"], stderr=subprocess.DEVNULL) as peer:
        peer.call("open_session", session="g")
        reply = peer.call("generate", session="g", messages=CONVERSATION, max_new_tokens=2)
        assert reply["ok"], reply
        expected = rendered(plain_engine, CONVERSATION, chat_template=PLAIN_TEMPLATE, add_generation_prompt=True)
        assert reply["result"]["stats"]["prompt_tokens"] == len(expected)
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
