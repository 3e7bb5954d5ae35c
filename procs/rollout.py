"""Rollout producer process: dataset prompts -> engine /generate -> RolloutGroups PUSHed to reward.

Run: python procs/rollout.py [--config FILE] [--section.key=value ...]   (usually by supervisord)
"""

from nano_miles.run.cli import ArgumentParser, run


def main(argv: list[str]) -> int:
    import signal

    from nano_miles.run.process import die_with_parent
    die_with_parent(signal.SIGKILL)  # first, and at once: it holds nothing durable to finish
    from nano_miles.run.config import parse_config
    cfg, _ = parse_config(argv, ArgumentParser(prog="python procs/rollout.py", description=__doc__))
    from nano_miles.rollouts import load_rollout
    from nano_miles.tasks import load_problems
    from nano_miles.tasks.prompts import encode_prompts, load_tokenizer, stop_token_ids
    problems = load_problems(cfg, "train")  # a task that cannot serve the config: one line, now
    load_rollout(cfg.rollout)  # and a rollout function that does not import
    import zmq

    from nano_miles.run.process import setup_process
    from nano_miles.stages.rollout.producer import RolloutProducer

    tokenizer = load_tokenizer(cfg.model_dir)
    prompts = encode_prompts(tokenizer, problems, cfg.task)
    stops = stop_token_ids(cfg.model_dir, tokenizer, chat_template=cfg.task.chat_template)
    setup_process("rollout", cfg)
    producer = RolloutProducer(cfg, zmq.Context.instance(), problems, prompts, stops, tokenizer)
    try:
        producer.run()
    finally:  # SIGTERM from supervisord exits through here: sockets and HTTP sessions closed
        producer.close()
    return 0


if __name__ == "__main__":
    run(main, "rollout")
