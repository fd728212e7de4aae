# One device session: wheels, then each check with its own time limit; everything into $OUT.
# DEV=cpu runs the same script here (no wheels) to catch mistakes before the GPU is held.
set -u
DEV=${DEV:-cuda}
export PYTHONUNBUFFERED=1 NEMO_D3S_ALLOW_UNTESTED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
if [ "$DEV" = cuda ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
R=${R:-/tmp/r}; rm -rf $R; mkdir -p $R; L=$OUT/log.txt; t0=$SECONDS
step() { local name=$1 lim=$2; shift 2; echo "=== $name (t=$((SECONDS-t0)) s)" | tee -a $L
  timeout -k 5 $lim "$@" >> $L 2>&1; echo "=== $name rc=$? (t=$((SECONDS-t0)) s)" | tee -a $L
  tar czf $OUT/runs.tgz --exclude="*.safetensors" -C $R . 2>/dev/null; }
TRAIN="$PY -m nemo_d3s.train"
TR1="$PY -m torch.distributed.run --nproc_per_node=1 -m nemo_d3s.train"
COMMON="experiment=smoke model.device=$DEV trainer.steps=6 trainer.eval_every=3"
[ "$DEV" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> $L
[ "${SKIP_SC:-0}" = 1 ] || step selfcheck 150 $PY -m nemo_d3s.selfcheck --out $R/sc
step hf_k0 60 $TRAIN $COMMON output_dir=$R/hf_k0
step hf_k1 60 $TRAIN $COMMON rollout.max_staleness=1 output_dir=$R/hf_k1
step meg_k0 90 $TR1 $COMMON model=megatron +model.params.transformer_impl=local output_dir=$R/meg_k0
step meg_k1 90 $TR1 $COMMON model=megatron +model.params.transformer_impl=local rollout.max_staleness=1 output_dir=$R/meg_k1
step moe_make 60 $PY -c "import sys; sys.path.insert(0,'tests/backends/megatron'); from _tiny_hf import make_tiny_hf; make_tiny_hf('$R/moe_hf','qwen3_moe',layers=2)"
MOE="experiment=smoke trainer.steps=3 trainer.eval_every=0 trainer.eval_at_start=false trainer.save_every=1 trainer.max_new_tokens=12 task.eval_size=4 ~model.params.tiny model.name=$R/moe_hf"
step moe_hf 90 $TRAIN $MOE model.device=$DEV output_dir=$R/moe_hf_run
for d in alltoall allgather; do
step moe_meg_$d 90 $TR1 $MOE model.backend=megatron model.device=$DEV +model.params.transformer_impl=local +model.params.moe_token_dispatcher_type=$d output_dir=$R/moe_meg_$d
done
step moe_convert 60 $PY -m nemo_d3s.convert megatron-to-hf --ckpt $R/moe_meg_alltoall/checkpoints/step_000003 --out $R/moe_back --quiet
step moe_compare 30 $PY -c "
from safetensors.torch import load_file; import glob
a={};b={}
[a.update(load_file(f)) for f in glob.glob('$R/moe_meg_alltoall/hf_export/*.safetensors')]
[b.update(load_file(f)) for f in glob.glob('$R/moe_back/*.safetensors')]
assert a.keys()==b.keys() and a, (len(a), len(b))
bad=[k for k in a if not a[k].equal(b[k])]
print('tensors', len(a), 'dtype', next(iter(a.values())).dtype, 'unequal', bad)"
BIG="model.params.tiny.hidden_size=${BIG_H:-1024} model.params.tiny.num_layers=${BIG_L:-12} model.params.tiny.num_heads=16 model.params.tiny.num_kv_heads=4 model.params.tiny.intermediate_size=${BIG_F:-4096} model.dtype=${BIG_DT:-bfloat16} trainer.prompts_per_step=8 trainer.num_generations=8 trainer.max_new_tokens=${BIG_T:-128} trainer.micro_batch_size=16 trainer.steps=${BIG_S:-10} trainer.eval_every=0 trainer.eval_at_start=false trainer.save_every=0 trainer.export_hf=false"
for k in 0 1; do
step big_k$k 120 $TRAIN experiment=smoke model.device=$DEV $BIG rollout.max_staleness=$k output_dir=$R/big_k$k
done
ls -la $OUT
