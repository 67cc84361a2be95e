"""The instruction-following environment as a specification (zoo/rl/envs/instructions.py): each format
constraint accepts what obeys it and refuses what does not, every query's reference completion satisfies all
its constraints, the reward is the share satisfied or all-or-nothing, held-out prompts are never training
prompts, and the datamodule serves the queries to RLTask in the chat format when the vocabulary has roles."""

import json

import pytest

from zoo.rl.envs.data import InstructionRLDataModule
from zoo.rl.envs.instructions import (
    CONSTRAINTS,
    InstructionTasks,
    constraints_of,
    verify_instructions,
    verify_instructions_all,
)
from zoo.rl.records import Query
from zoo.rl.verifiers import VerifierPool, verifier_for
from zoo.tokenizers.vocab import UnifiedVocab


def query(*constraints: tuple[str, str], task: str = "instructions") -> Query:
    return Query("q/1", "prompt", json.dumps([list(c) for c in constraints]), "", task)


@pytest.mark.parametrize(
    "kind, value, good, bad",
    [
        ("words", "3", "the sum is", "the sum is 19"),
        ("include", "red", "a Red circle", "a reddish circle"),
        ("answer_line", "19", "12+7 is 19 Answer: 19", "Answer: 19 is it"),
        ("answer_line", "19", "Answer: 19", "XAnswer: 19"),
        ("lowercase", "", "a small red circle", "a Small red circle"),
        ("uppercase", "", "A SMALL RED CIRCLE", "A SMALL red CIRCLE"),
        ("json_key", "answer", '{"answer": "red"}', '{"reply": "red"}'),
        ("json_key", "answer", '{"answer": 1}', "answer: red"),
    ],
)
def test_each_constraint_accepts_what_obeys_it_and_refuses_what_does_not(kind, value, good, bad):
    q = query((kind, value))
    assert verify_instructions(q, good) == 1.0
    assert verify_instructions(q, bad) == 0.0


def test_case_constraints_need_a_letter_and_surrounding_spaces_do_not_count():
    assert verify_instructions(query(("lowercase", "")), "12+7") == 0.0
    assert verify_instructions(query(("words", "2")), "  two words \n") == 1.0


def test_the_reward_is_the_share_satisfied_or_all_or_nothing():
    constraints = (("lowercase", ""), ("words", "4"), ("include", "sum"))
    text = "the sum is nineteen now"  # lowercase and "sum", but five words
    assert verify_instructions(query(*constraints), text) == pytest.approx(2 / 3)
    assert verify_instructions_all(query(*constraints, task="instructions_all"), text) == 0.0
    assert verify_instructions_all(query(*constraints, task="instructions_all"), "the sum is nineteen") == 1.0
    assert verifier_for("instructions") is verify_instructions
    assert verifier_for("instructions_all") is verify_instructions_all


@pytest.mark.parametrize("reward", ["fraction", "all"])
def test_every_reference_completion_satisfies_all_its_constraints(reward):
    tasks = InstructionTasks(counts=(1, 2, 3), reward=reward, seed=3)
    for split in ("train", "heldout"):
        for q in tasks.queries(split, 60):
            assert verifier_for(q.task)(q, q.solution) == 1.0, q
            assert 1 <= len(constraints_of(q)) == q.difficulty <= 3
            assert q.task == {"fraction": "instructions", "all": "instructions_all"}[reward]


def test_every_constraint_kind_and_both_contents_are_drawn():
    queries = InstructionTasks(counts=(1, 2, 3)).queries("train", 200)
    assert {c.kind for q in queries for c in constraints_of(q)} == set(CONSTRAINTS)
    assert {q.id.split("/")[0] for q in queries} == {"arith", "caption"}


def test_queries_are_seeded_and_heldout_prompts_are_never_training_prompts():
    tasks = InstructionTasks(counts=(1, 2), seed=0)
    train, heldout = tasks.queries("train", 300), tasks.queries("heldout", 60)
    assert tasks.queries("train", 300) == train
    assert {q.prompt for q in train}.isdisjoint(q.prompt for q in heldout)
    assert InstructionTasks(counts=(1, 2), seed=1).queries("train", 20) != train[:20]


def test_a_query_whose_constraints_do_not_parse_is_refused_by_name():
    bad = Query("arith/1/train/7", "p", '[["shout", ""]]', "", "instructions")
    with pytest.raises(ValueError, match="arith/1/train/7.*kinds among"):
        verify_instructions(bad, "text")
    with pytest.raises(ValueError, match="contents must be"):
        InstructionTasks(contents=("poems",))
    with pytest.raises(ValueError, match="counts must be"):
        InstructionTasks(counts=(4,))


def test_the_verifier_pool_scores_instruction_queries_like_any_other():
    q = InstructionTasks(counts=(2,)).query(0)
    with VerifierPool(workers=0) as pool:
        results = pool.score([q, q], [q.solution, ""])
    assert [r.reward for r in results] == [1.0, 0.0] and all(r.ok for r in results)


def test_prompts_are_a_user_turn_and_the_assistants_opening_when_the_vocabulary_has_roles():
    vocab = UnifiedVocab(text_size=300, chat=True)
    data = InstructionRLDataModule(vocab=vocab, train_size=16, heldout_size=4, tokenizer_size=300)
    data.setup()
    q = data.train_queries()[0]
    ids = data.base_prompt_ids(q)
    assert ids[:2] == [vocab.bos_id, vocab.special("<|user|>")] and ids[-1] == vocab.special("<|assistant|>")
    assert data.decode(ids) == q.prompt
    plain = InstructionRLDataModule(vocab=UnifiedVocab(text_size=300), train_size=16, tokenizer_size=300)
    plain.setup()
    assert plain.base_prompt_ids(q)[1:] == plain.encode_text(q.prompt)
