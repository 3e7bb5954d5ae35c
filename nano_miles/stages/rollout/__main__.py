"""Rollout producer process: dataset prompts -> engine /generate -> RolloutGroups PUSHed to reward.

Run: python -m nano_miles.stages.rollout [--config FILE] [--section.key=value ...]   (usually by supervisord)
"""

from nano_miles.run.cli import ArgumentParser, run


def main(argv: list[str]) -> int:
    from nano_miles.run.config import parse_config
    cfg, _ = parse_config(argv, ArgumentParser(prog="python -m nano_miles.stages.rollout", description=__doc__))
    import zmq

    from nano_miles.run.process import setup_process
    from nano_miles.stages.rollout.producer import RolloutProducer
    from nano_miles.tasks import encode_prompts, load_task, load_tokenizer

    setup_process("rollout", cfg)
    problems = load_task(cfg.task.name).make_problems("train", cfg.task.num_train, cfg.task.seed)
    prompts = encode_prompts(load_tokenizer(cfg.model_dir), problems)
    RolloutProducer(cfg, zmq.Context.instance(), problems, prompts).run()
    return 0


if __name__ == "__main__":
    run(main, "rollout")
