# Third device call: the MoE model on the Megatron backend with CUDA's default optimizer
# (Megatron's distributed optimizer, refused before c0a8e18), a checkpoint each step, its
# conversion to HF against the export, and a resume from it.
set -u
export PYTHONUNBUFFERED=1 NEMO_D3S_ALLOW_UNTESTED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}; DEV=${DEV:-cuda}; EXTRA=${EXTRA:-}
if [ "$DEV" = cuda ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else export PYTHONPATH=$PWD; fi
R=${R:-/tmp/r}; rm -rf $R; mkdir -p $R; L=$OUT/log3.txt; t0=$SECONDS
step() { local name=$1 lim=$2; shift 2; echo "=== $name (t=$((SECONDS-t0)) s)" | tee -a $L
  timeout -k 5 $lim "$@" >> $L 2>&1; echo "=== $name rc=$? (t=$((SECONDS-t0)) s)" | tee -a $L
  tar czf $OUT/runs3.tgz --exclude="*.safetensors" -C $R . 2>/dev/null; }
TR1="$PY -m torch.distributed.run --nproc_per_node=1 -m nemo_d3s.train"
step moe_make 40 $PY -c "import sys; sys.path.insert(0,'tests/backends/megatron'); from _tiny_hf import make_tiny_hf; make_tiny_hf('$R/moe_hf','qwen3_moe',layers=2)"
MOE="experiment=smoke trainer.eval_every=0 trainer.eval_at_start=false trainer.save_every=1 trainer.max_new_tokens=12 task.eval_size=4 ~model.params.tiny model.name=$R/moe_hf model.backend=megatron model.device=$DEV +model.params.transformer_impl=local $EXTRA"
step moe_dopt 60 $TR1 $MOE trainer.steps=3 output_dir=$R/moe_dopt
step moe_resume 60 $TR1 $MOE trainer.steps=4 resume=true output_dir=$R/moe_dopt
step moe_convert 40 $PY -m nemo_d3s.convert megatron-to-hf --ckpt $R/moe_dopt/checkpoints/step_000004 --out $R/moe_back --quiet
step moe_compare 30 $PY -c "
from safetensors.torch import load_file; from safetensors import safe_open; import glob, json
a={};b={}
[a.update(load_file(f)) for f in glob.glob('$R/moe_dopt/hf_export/*.safetensors')]
[b.update(load_file(f)) for f in glob.glob('$R/moe_back/*.safetensors')]
assert a.keys()==b.keys() and a, (len(a), len(b))
bad=[k for k in a if not a[k].equal(b[k])]
f=safe_open(glob.glob('$R/moe_dopt/checkpoints/step_000003/megatron/ep00*.safetensors')[0],'pt')
ks=list(f.keys()); print('expert file keys', len(ks), 'moments', sum(k.startswith('optim.exp_avg') for k in ks), 'main', sum(k.startswith('optim.main') for k in ks))
print('tensors', len(a), 'unequal', bad)
print('optimizer', open('$R/moe_dopt/train.log').read().count('distributed'))"
ls -la $OUT
