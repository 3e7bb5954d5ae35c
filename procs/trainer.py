"""Trainer process: scored groups -> GRPO steps -> weight hot-updates of the engine; ends the run.

Run: python procs/trainer.py [--config FILE] [--section.key=value ...]   (usually by supervisord)
Exits 0 when `trainer.num_steps` are done (supervisord's listener then ends the whole run), 2 when it
refuses to start (a config it cannot run, a finished run, a checkpoint of another train split), and
143 after a SIGTERM, once the last step it trained is checkpointed: supervisord restarts it after a
plain `kill` (it resumes from that step), and leaves it stopped when it is stopping the run itself.
With `trainer.strategy = "fsdp2"` this process launches `trainer.world_size` ranks of itself and exits
as rank 0 does (`nano_miles/stages/trainer/ranks.py`); any rank that dies ends them all (exit 1).
"""

import os

from nano_miles.run.cli import ArgumentParser, run

RANK = int(os.environ.get("RANK", "0"))  # torch's launcher names each rank of a sharded trainer


def main(argv: list[str]) -> int:
    from nano_miles.run.process import die_with_parent
    die_with_parent()  # first: a supervisord killed while this process starts leaves no orphan
    from nano_miles.run.config import parse_config
    cfg, _ = parse_config(argv, ArgumentParser(prog="python procs/trainer.py", description=__doc__))
    from nano_miles.rewards import load_reward
    from nano_miles.run.identity import refuse_a_finished_run
    from nano_miles.tasks import load_problems, split_identity
    refuse_a_finished_run(cfg.run_dir)  # a second supervisord on a finished run: one line, nothing started
    # plug-ins and data that cannot serve the config: one line now, before the heavy imports
    reward_fn, test_problems = load_reward(cfg.reward), load_problems(cfg, "test")
    split = split_identity(cfg, load_problems(cfg, "train"))  # group ids <-> positions in the train split
    from nano_miles.stages.trainer import ranks
    if ranks.is_launcher(cfg.trainer.strategy):
        return ranks.launch(__file__, argv, cfg.trainer.world_size)
    import logging
    import signal

    import zmq

    from nano_miles.engine.client import EngineError
    from nano_miles.rewards.worker import RewardWorker
    from nano_miles.run.process import EXIT_STOPPED, StopRequested, setup_process
    from nano_miles.stages.trainer import memory_plan
    from nano_miles.stages.trainer.evaluate import make_evaluator
    from nano_miles.stages.trainer.step_loop import Trainer
    from nano_miles.tasks.prompts import load_tokenizer, stop_token_ids
    from nano_miles.wire.sockets import ControlTimeout

    cfg, chosen = memory_plan.fit_to_device(cfg)  # with trainer.memory_plan: what fits beside SGLang
    tokenizer = load_tokenizer(cfg.model_dir)
    world, group = ranks.join(cfg.trainer.device) if cfg.trainer.strategy == "fsdp2" else (1, None)
    if RANK != 0:  # a rank that holds its shards and does what rank 0 names
        return ranks.serve(cfg, tokenizer, RANK, world, group)
    stops = stop_token_ids(cfg.model_dir, tokenizer, chat_template=cfg.task.chat_template)
    worker = RewardWorker(reward_fn, cfg.reward.timeout_s, cfg.reward.num_workers)
    worker.start()  # forked now, before the model, sockets and threads exist
    evaluator = make_evaluator(cfg, test_problems, tokenizer, worker, stops)
    setup_process("trainer", cfg, num_threads=cfg.trainer.num_threads, is_log_copied=True)
    if chosen is not None:
        logging.getLogger("trainer").info("memory plan: %s", chosen.describe())
    trainer = Trainer(cfg, zmq.Context.instance(), ranks.load_policy(cfg), tokenizer, evaluator, split,
                      world=world, group=group)  # may refuse the run dir
    signal.signal(signal.SIGTERM, lambda *_: trainer.request_stop())
    (cfg.run_dir / "config.toml").write_text(cfg.to_toml())
    code = 0
    try:
        trainer.train()
    except StopRequested:
        code = EXIT_STOPPED
    except (TimeoutError, ControlTimeout, EngineError) as e:  # a peer gone for good, or a request the
        # engine refuses (it is not retried): exit, supervisord restarts us
        logging.getLogger("trainer").error("cannot continue: %s", e)
        code = 1
    trainer.ranks.finish(code)  # the other ranks leave with this one
    return code


if __name__ == "__main__":
    # its stderr goes to the terminal: trainer.log gets the line too (another rank's: trainer.rankN.log)
    run(main, "trainer" if RANK == 0 else f"trainer.rank{RANK}", is_log_copied=True, is_hard_exit="RANK" in os.environ)
