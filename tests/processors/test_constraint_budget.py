"""The memory of bound constraints is bounded: a binding that would pass the budget is refused with a typed
error naming the limit, and what bound processors hold is counted against the automata they reference."""

import gc
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from processors import Chain, configure
from processors.structured import Dfa, Regex, Vocabulary, budget

ROOT = Path(__file__).resolve().parents[2]
EOS = 2


@pytest.fixture(scope="module")
def vocab():
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(ROOT / "sidecar/default_model/tokenizer.json"),
                                        eos_token="</s>", bos_token="<s>", pad_token="<pad>")
    return Vocabulary.from_tokenizer(tokenizer, 1024)


def chain_dfa(offset: int, states: int = 339):
    """A user's automaton whose every state allows one token of its own: one mask row per state."""
    return configure(Dfa, initial_state=0, transitions=[[i, (i * 7 + offset) % 1000 + 3, i + 1] for i in range(states)],
                     accepting_states=[states])


def distinct_automata_bytes(chains) -> int:
    """What the chains' processors reference, each automaton once: the reference the budget must agree with."""
    automata = {id(p.automaton): p.automaton for chain in chains for p in chain.processors}
    return sum(a.reserved_bytes for a in automata.values())


@pytest.fixture
def budget_of(monkeypatch):
    assert budget.held_bytes() == 0, "a processor of another test is still bound"
    return lambda n: monkeypatch.setattr(budget, "_budget_bytes", n)


def test_a_binding_past_the_budget_is_refused_and_dropped_processors_give_their_bytes_back(vocab, budget_of):
    one = Chain([chain_dfa(0)]).bind(vocab, [EOS])
    size = distinct_automata_bytes([one])
    assert budget.held_bytes() == size
    budget_of(4 * size + size // 2)
    chains = [one] + [Chain([chain_dfa(k)]).bind(vocab, [EOS]) for k in range(1, 4)]
    assert budget.held_bytes() == distinct_automata_bytes(chains) == 4 * size
    with pytest.raises(budget.ConstraintBudgetExceeded) as refused:
        Chain([configure(Regex, pattern="[a-z]+"), chain_dfa(9)]).bind(vocab, [EOS])
    error = refused.value
    assert (error.code, error.limit, error.index) == ("limit_exceeded", "constraint_budget_bytes", 1)
    assert error.maximum == 4 * size + size // 2 and error.value > error.maximum
    assert str(error).startswith("processors[1] (dfa): ") and "constraint_budget_bytes" in str(error)
    assert "may fit once generations finish" in str(error)
    assert budget.held_bytes() == 4 * size, "the refused chain's regex, bound before the dfa, was not given back"
    chains.pop()
    assert budget.held_bytes() == 3 * size
    chains.append(Chain([chain_dfa(9)]).bind(vocab, [EOS]))
    del one
    chains.clear()
    assert budget.held_bytes() == 0


def test_a_constraint_over_the_budget_on_its_own_says_so(vocab, budget_of):
    budget_of(100_000)
    with pytest.raises(budget.ConstraintBudgetExceeded, match="on its own") as refused:
        Chain([chain_dfa(0)]).bind(vocab, [EOS])
    assert refused.value.index == 0 and refused.value.maximum == 100_000
    assert budget.held_bytes() == 0
    # a compiled regex is in the compile cache before it is bound: what it needs is still all of it (the
    # message said its tables were held by others, on a budget nothing else held)
    with pytest.raises(budget.ConstraintBudgetExceeded, match="on its own") as refused:
        Chain([configure(Regex, pattern="[a-z]{3,10}")]).bind(vocab, [EOS])
    assert f"needs {refused.value.value:,} bytes" in str(refused.value)


def test_an_automaton_shared_by_many_processors_counts_once(vocab, budget_of):
    first = Chain([configure(Regex, pattern="[0-9]{3}-[a-z]{2,5}")]).bind(vocab, [EOS])
    size = budget.held_bytes()
    assert size == distinct_automata_bytes([first]) > 0
    budget_of(size + 1)
    chains = [first] + [Chain([configure(Regex, pattern="[0-9]{3}-[a-z]{2,5}")]).bind(vocab, [EOS]) for _ in range(50)]
    assert len({id(chain.processors[0].automaton) for chain in chains}) == 1
    assert budget.held_bytes() == size
    del first
    chains.clear()
    assert budget.held_bytes() == 0


def test_processors_dropped_in_a_reference_cycle_are_collected_before_a_refusal(vocab, budget_of):
    held = Chain([chain_dfa(0)]).bind(vocab, [EOS])
    size = budget.held_bytes()
    budget_of(size + size // 2)
    cycle = [held]
    cycle.append(cycle)
    del held, cycle
    gc.disable()
    try:
        assert budget.held_bytes() == size  # not collected yet
        again = Chain([chain_dfa(1)]).bind(vocab, [EOS])
    finally:
        gc.enable()
    assert budget.held_bytes() == size
    del again
    assert budget.held_bytes() == 0


def test_the_budget_is_a_number_of_bytes():
    for wrong in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="number of bytes"):
            budget.set_budget_bytes(wrong)
    assert budget.budget_bytes() == budget.DEFAULT_BUDGET_BYTES


def test_lazy_masks_count_at_what_they_may_grow_to_and_a_cached_automaton_adds_only_new_ones(vocab, budget_of):
    """A lazily compiled automaton grows a mask row for each new state a generation reaches, past what was
    checked when it was bound (12 generations with other end tokens took 3.5 times an 8 MiB budget): its
    masks count at a row for every state. The compile cache keeps it, so binding it again adds nothing
    (counted whole, one grown past the budget was refused on its own ever after), but masks for other end
    tokens are new, and go with a refusal."""
    pattern = "[a-z]{0,400}"
    first = Chain([configure(Regex, pattern=pattern)]).bind(vocab, [EOS])
    automaton = first.processors[0].automaton
    states = len(automaton.moves)
    assert budget.held_bytes() == automaton.reserved_bytes >= states * 1024 * 4 > automaton.nbytes
    masks = first.processors[0].masks
    for state in range(300):  # as a generation reaching 300 states
        masks.row(state)
    reserved = automaton.reserved_bytes
    assert budget.held_bytes() == reserved
    del first, masks
    assert budget.held_bytes() == 0
    budget_of(reserved // 2)
    again = Chain([configure(Regex, pattern=pattern)]).bind(vocab, [EOS])
    assert again.processors[0].automaton is automaton and budget.held_bytes() == reserved
    with pytest.raises(budget.ConstraintBudgetExceeded):
        Chain([configure(Regex, pattern=pattern)]).bind(vocab, [EOS, 3])
    assert automaton.reserved_bytes == reserved, "the refused binding's masks were kept"
    del again
    assert budget.held_bytes() == 0
