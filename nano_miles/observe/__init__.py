"""What you can watch: Prometheus metrics of every stage (`metrics.py`), scraping them (`scrape.py`),
the live view (`top.py`), a one-shot status (`status.py`), the trainer's run record (`run_record.py`:
metrics.jsonl, sinks, summary, ledger report), plots (`plots.py`) and the end-of-run report (`report.py`)."""
