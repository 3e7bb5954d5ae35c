"""Reward process: PULLs RolloutGroups, scores them, PUSHes ScoredGroups (rewards; the trainer makes advantages).

Run: python procs/reward.py [--config FILE] [--section.key=value ...]   (usually by supervisord)
"""

from nano_miles.run.cli import ArgumentParser, run


def main(argv: list[str]) -> int:
    import signal

    from nano_miles.run.process import die_with_parent
    die_with_parent(signal.SIGKILL)  # first, and at once: it holds nothing durable to finish
    from nano_miles.run.config import parse_config
    cfg, _ = parse_config(argv, ArgumentParser(prog="python procs/reward.py", description=__doc__))
    from nano_miles.rewards import load_reward
    from nano_miles.tasks import load_problems
    from nano_miles.tasks.prompts import load_tokenizer, make_decoder
    reward_fn = load_reward(cfg.reward)  # one that does not import: one line, before anything starts
    problems = load_problems(cfg, "train")  # each group's prompt and record fields, by its index
    import zmq

    from nano_miles.run.process import setup_process
    from nano_miles.stages.reward.scorer import RewardStage

    setup_process("reward", cfg, num_threads=1)
    stage = RewardStage(cfg, zmq.Context.instance(), reward_fn, make_decoder(load_tokenizer(cfg.model_dir)), problems)
    try:
        stage.run()
    finally:  # SIGTERM from supervisord exits through here: the worker child goes with us
        stage.close()
    return 0


if __name__ == "__main__":
    run(main, "reward")
