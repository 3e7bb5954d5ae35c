"""Tests of the arithmetic task, its reward and the reward plug-in loader.
Run: pytest tests/test_task.py
"""

import re

import pytest

from nano_miles.run.cli import UserError
from nano_miles.run.plugins import load_function
from nano_miles.run.config import Config
from nano_miles.run.sections import TaskConfig
from nano_miles.tasks import load_problems
from nano_miles.tasks.arithmetic import (Expression, Problem, extract_answer, make_expressions, make_problems,
                                         render_prompt, reward, split_of)

EXPRESSION_RE = re.compile(r"What is (.+)\? Put the answer in <answer></answer>\.\n")


def expression_of(problem: Problem) -> str:
    match = EXPRESSION_RE.fullmatch(problem.prompt)
    assert match, problem.prompt
    return match.group(1)


def test_problems_are_deterministic_per_seed():
    assert make_problems("train", 50, seed=3) == make_problems("train", 50, seed=3)
    assert make_problems("train", 50, seed=3) != make_problems("train", 50, seed=4)


def test_splits_are_disjoint():
    train = {expression_of(p) for p in make_problems("train", 5000)}
    test = {expression_of(p) for p in make_problems("test", 2000)}
    assert not train & test
    assert all(split_of(e) == "test" for e in test)


def test_test_split_is_prefix_stable():
    long = make_problems("test", 300)
    for k in (0, 1, 17, 200):
        assert make_problems("test", k) == long[:k]


def test_problems_are_distinct():
    expressions = [expression_of(p) for p in make_problems("test", 1000)]
    assert len(set(expressions)) == len(expressions)


def test_answers_evaluate_from_the_expression():
    problems = make_problems("train", 300, seed=1) + make_problems("test", 300)
    for p in problems:
        expression = expression_of(p)
        assert re.fullmatch(r"[0-9 ()+\-*]+", expression)  # safe to hand to eval
        assert expression.count("(") == 1
        assert str(eval(expression)) == p.answer
    assert any(p.answer.startswith("-") for p in problems)
    assert {op for p in problems for op in "+-*" if op in expression_of(p)} == {"+", "-", "*"}


def test_worked_response_is_scored_correct():
    for e in make_expressions("train", 100):
        problem = Problem(render_prompt(e.text()), str(e.value()))
        assert reward(e.worked_response(), problem.answer) == {"reward": 1.0, "format": 1.0, "accuracy": 1.0,
                                                                 "first_step": 0.0}


def test_example_from_the_docs():
    left = Expression(a=7, op_inner="*", b=4, op_outer="+", c=12, is_left=True)
    assert (left.text(), left.value()) == ("(7 * 4) + 12", 40)
    assert left.worked_response() == "7*4=28, 28+12=40 <answer>40</answer>"
    right = Expression(a=12, op_inner="*", b=6, op_outer="-", c=10, is_left=False)
    assert (right.text(), right.value()) == ("10 - (12 * 6)", -62)
    assert right.worked_response() == "12*6=72, 10-72=-62 <answer>-62</answer>"


@pytest.mark.parametrize("split, num", [("valid", 1), ("TEST", 1), ("train", -1), ("test", 10**6), ("test", 2.0)])
def test_bad_split_or_num_raises(split, num):
    with pytest.raises(ValueError, match="split|num"):
        make_problems(split, num)


@pytest.mark.parametrize("text, expected", [
    ("<answer>87</answer>", "87"),
    ("15*4=60, 60+27=87 <answer>87</answer>", "87"),
    ("<answer>  -12 \n</answer>", "-12"),
    ("<answer>-0</answer>", "-0"),
    ("<answer>1</answer> then <answer>2</answer>", "2"),
    ("<answer>1</answer> then <answer>2", "1"),  # a trailing unclosed tag is not an answer
    ("<answer>5 <answer>7</answer>", "7"),
    ("<answer>87", None),
    ("87</answer>", None),
    ("</answer>87<answer>", None),
    ("no tags, 87", None),
    ("", None),
    ("<answer></answer>", None),
    ("<answer>8 7</answer>", None),
    ("<answer>+87</answer>", None),
    ("<answer>87.0</answer>", None),
    ("<answer>- 87</answer>", None),
    ("<answer>eighty</answer>", None),
    ("<answer>٨٧</answer>", None),  # non-ASCII digits
    ("<answer>1</answer><answer>x</answer>", None),  # the last tag decides, even if it is garbage
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("response, label, expected", [
    ("<answer>87</answer>", "87", (1.0, 1.0, 1.0)),
    ("<answer> -12 </answer>", "-12", (1.0, 1.0, 1.0)),
    ("<answer>012</answer>", "12", (1.0, 1.0, 1.0)),
    ("<answer>12</answer>", "-12", (0.1, 1.0, 0.0)),
    ("<answer>87</answer><answer>86</answer>", "87", (0.1, 1.0, 0.0)),
    ("87", "87", (0.0, 0.0, 0.0)),
    ("<answer>87", "87", (0.0, 0.0, 0.0)),
    ("<answer>8x7</answer>", "87", (0.0, 0.0, 0.0)),
])
def test_reward(response, label, expected):
    result = reward(response, label)
    assert set(result) == {"reward", "format", "accuracy", "first_step"}
    assert (result["reward"], result["format"], result["accuracy"]) == pytest.approx(expected)


@pytest.mark.parametrize("response, first_step", [
    ("7*4=28, 28+12=40 <answer>28</answer>", 1.0),   # the habit: the first step's result tagged
    ("7*4=28, 28+12=40 <answer>40</answer>", 0.0),   # the worked answer
    ("7*4=27, 27+12=39 <answer>27</answer>", 1.0),   # a wrong first step, still tagged: the habit
    ("7*4=28, 28+12=40 <answer>12</answer>", 0.0),   # some other number
    ("3*4=12, 12+0=12 <answer>12</answer>", 0.0),    # steps that agree cannot show it
    ("7*4=28 <answer>28</answer>", 0.0),             # one step only
    ("7*4=28, 28+12=40 <answer>28", 0.0),            # no closed tag, no answer
])
def test_first_step_part(response, first_step):
    assert reward(response, "40")["first_step"] == first_step


@pytest.mark.parametrize("dotted", ["nano_miles.tasks.arithmetic:reward", "nano_miles.tasks.arithmetic.reward"])
def test_load_function_both_syntaxes(dotted):
    fn = load_function(dotted, "reward.fn")
    assert fn is reward
    assert fn("<answer>3</answer>", "3")["reward"] == 1.0


@pytest.mark.parametrize("dotted", [
    "nano_miles.tasks.no_such_module:reward",
    "nano_miles.tasks.arithmetic:no_such_function",
    "nano_miles.tasks.arithmetic:MAX_OPERAND",  # exists, not callable
    "no_dots_at_all",
    ":reward",
    "nano_miles.tasks.arithmetic:",
])
def test_load_function_bad_path_names_it(dotted):
    with pytest.raises(UserError) as info:
        load_function(dotted, "reward.fn")
    assert repr(dotted) in str(info.value)


def test_load_problems_checks_the_task_against_the_config():
    assert load_problems(Config(task=TaskConfig(num_test=5, seed=1)), "test") == make_problems("test", 5, seed=1)
    everything = load_problems(Config(task=TaskConfig(num_train=0, seed=1)), "train")
    assert everything[:7] == make_problems("train", 7, seed=1) and len(everything) > 20000  # 0 = all
    with pytest.raises(UserError, match=r"task.num_train is 999999, but the train split of .* holds [0-9]+ problems: "
                                        r"set at most [0-9]+, or 0 to take them all"):
        load_problems(Config(task=TaskConfig(num_train=999999)), "train")
    with pytest.raises(UserError, match="task.name 'nope.task': cannot import"):
        load_problems(Config(task=TaskConfig(name="nope.task")), "train")
    with pytest.raises(UserError, match=r"task.name 'nano_miles.tasks': a task module provides load_split"):
        load_problems(Config(task=TaskConfig(name="nano_miles.tasks")), "train")
