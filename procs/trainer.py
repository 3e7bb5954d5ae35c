"""Trainer process: scored groups -> GRPO steps -> weight hot-updates of the engine; ends the run.

Run: python procs/trainer.py [--config FILE] [--section.key=value ...]   (usually by supervisord)
Exits 0 when `trainer.num_steps` are done (supervisord's listener then ends the whole run), 2 when it
refuses to start (a config it cannot run, a finished run, a checkpoint of another train split), and
143 after a SIGTERM, once the last step it trained is checkpointed: supervisord restarts it after a
plain `kill` (it resumes from that step), and leaves it stopped when it is stopping the run itself.
"""

from nano_miles.run.cli import ArgumentParser, UserError, run


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
    import logging
    import signal

    import torch
    import zmq
    from transformers import AutoModelForCausalLM

    from nano_miles.engine.client import EngineError
    from nano_miles.rewards.worker import RewardWorker
    from nano_miles.run.process import EXIT_STOPPED, StopRequested, setup_process
    from nano_miles.stages.trainer import lora
    from nano_miles.stages.trainer.evaluate import make_evaluator
    from nano_miles.stages.trainer.step_loop import Trainer
    from nano_miles.tasks.prompts import load_tokenizer, stop_token_ids
    from nano_miles.wire.sockets import ControlTimeout

    device = torch.device(cfg.trainer.device)
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"trainer.device is {cfg.trainer.device!r}, but torch {torch.__version__} sees "
                        f"{torch.cuda.device_count()} CUDA devices here")
    chosen = None
    if cfg.trainer.memory_plan and device.type == "cuda":  # micro-batches and checkpointing that fit beside SGLang
        from nano_miles.stages.trainer import memory_plan
        chosen = memory_plan.plan_for(cfg, torch.cuda.get_device_properties(device).total_memory)
        cfg = memory_plan.apply(cfg, chosen)
    tokenizer = load_tokenizer(cfg.model_dir)
    stops = stop_token_ids(cfg.model_dir, tokenizer, chat_template=cfg.task.chat_template)
    worker = RewardWorker(reward_fn, cfg.reward.timeout_s, cfg.reward.num_workers)
    worker.start()  # forked now, before the model, sockets and threads exist
    evaluator = make_evaluator(cfg, test_problems, tokenizer, worker, stops)
    setup_process("trainer", cfg, num_threads=cfg.trainer.num_threads, is_log_copied=True)
    if chosen is not None:
        logging.getLogger("trainer").info("memory plan: %s", chosen.describe())
    torch.manual_seed(cfg.run.seed)
    model = AutoModelForCausalLM.from_pretrained(str(cfg.model_dir), dtype=torch.float32)
    model = lora.wrap(model, cfg.trainer).to(cfg.trainer.device)  # trainer.lora_rank > 0: adapters train
    trainer = Trainer(cfg, zmq.Context.instance(), model, tokenizer, evaluator, split)  # may refuse the run dir
    signal.signal(signal.SIGTERM, lambda *_: trainer.request_stop())
    (cfg.run_dir / "config.toml").write_text(cfg.to_toml())
    try:
        trainer.train()
    except StopRequested:
        return EXIT_STOPPED
    except (TimeoutError, ControlTimeout, EngineError) as e:  # a peer gone for good, or a request the
        # engine refuses (it is not retried): exit, supervisord restarts us
        logging.getLogger("trainer").error("cannot continue: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    run(main, "trainer", is_log_copied=True)  # its stderr goes to the terminal: trainer.log gets the line too
