#!/bin/bash
# Builds an offline bundle of TRL for bench/vs_trl.py on a GPU host without network access.
#   here (with PyPI):  bash bench/trl_bundle.sh OUTDIR
#   there:             bash OUTDIR/install.sh [SITE]      (default SITE: ~/trl-site)
#                      python bench/vs_trl.py --trl-pythonpath ~/trl-site ...
# The host is assumed to have Python 3.12, torch >= 2.11, transformers >= 5, accelerate, pandas,
# pyarrow, xxhash, fsspec and huggingface_hub (a CUDA image usually does); the bundle adds what TRL
# needs beyond that: trl, datasets, dill, multiprocess (~2 MB of wheels). They install into SITE,
# not into the host's packages, and TRL's process gets SITE as its PYTHONPATH, so an engine's pinned
# transformers on another path never meets TRL's.
set -euo pipefail
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
rm -f "$OUT"/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  -d "$OUT" trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
cat > "$OUT/install.sh" <<'INSTALL'
#!/bin/bash
# Installs the wheels beside this script into SITE (default ~/trl-site) and checks that TRL imports there.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); SITE=${1:-$HOME/trl-site}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$HERE"/*.whl
PYTHONPATH=$SITE python3 -c "import trl, datasets, transformers; print('trl', trl.__version__, 'datasets',
datasets.__version__, 'transformers', transformers.__version__, 'in', '$SITE')"
INSTALL
chmod +x "$OUT/install.sh"
du -sh "$OUT"; ls "$OUT"
