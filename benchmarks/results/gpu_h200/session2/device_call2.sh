# Second device call: is a k = 1 run reproducible from its seed on CUDA (two runs of each
# backend, bit-compared), and the MoE trainer on CUDA (Megatron, EP 1, both dispatchers, the
# plain optimizer), its checkpoint converted back to HF and compared with the run's export.
set -u
export PYTHONUNBUFFERED=1 NEMO_D3S_ALLOW_UNTESTED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}; DEV=${DEV:-cuda}
if [ "$DEV" = cuda ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else export PYTHONPATH=$PWD; fi
R=${R:-/tmp/r}; rm -rf $R; mkdir -p $R; L=$OUT/log2.txt; t0=$SECONDS
step() { local name=$1 lim=$2; shift 2; echo "=== $name (t=$((SECONDS-t0)) s)" | tee -a $L
  timeout -k 5 $lim "$@" >> $L 2>&1; echo "=== $name rc=$? (t=$((SECONDS-t0)) s)" | tee -a $L
  tar czf $OUT/runs2.tgz --exclude="*.safetensors" -C $R . 2>/dev/null; }
TRAIN="$PY -m nemo_d3s.train"
TR1="$PY -m torch.distributed.run --nproc_per_node=1 -m nemo_d3s.train"
COMMON="experiment=smoke model.device=$DEV trainer.steps=10 trainer.eval_every=5 rollout.max_staleness=1 trainer.export_hf=false trainer.save_every=0"
for i in a b; do
step hf_k1_$i 60 $TRAIN $COMMON output_dir=$R/hf_k1_$i
step meg_k1_$i 60 $TR1 $COMMON model=megatron +model.params.transformer_impl=local output_dir=$R/meg_k1_$i
done
step moe_make 40 $PY -c "import sys; sys.path.insert(0,'tests/backends/megatron'); from _tiny_hf import make_tiny_hf; make_tiny_hf('$R/moe_hf','qwen3_moe',layers=2)"
MOE="experiment=smoke trainer.steps=3 trainer.eval_every=0 trainer.eval_at_start=false trainer.save_every=1 trainer.max_new_tokens=12 task.eval_size=4 ~model.params.tiny model.name=$R/moe_hf"
for d in alltoall allgather; do
step moe_meg_$d 60 $TR1 $MOE model.backend=megatron model.device=$DEV +model.params.transformer_impl=local +model.params.distributed_optimizer=false +model.params.moe_token_dispatcher_type=$d output_dir=$R/moe_meg_$d
done
step moe_convert 40 $PY -m nemo_d3s.convert megatron-to-hf --ckpt $R/moe_meg_alltoall/checkpoints/step_000003 --out $R/moe_back --quiet
step moe_compare 30 $PY -c "
from safetensors.torch import load_file; import glob
a={};b={}
[a.update(load_file(f)) for f in glob.glob('$R/moe_meg_alltoall/hf_export/*.safetensors')]
[b.update(load_file(f)) for f in glob.glob('$R/moe_back/*.safetensors')]
assert a.keys()==b.keys() and a, (len(a), len(b))
bad=[k for k in a if not a[k].equal(b[k])]
print('tensors', len(a), 'dtype', next(iter(a.values())).dtype, 'unequal', bad)"
step compare 30 $PY -c "
import json
def rows(p): return [json.loads(l) for l in open(p)]
for n in ['hf_k1','meg_k1']:
    a,b=rows('$R/'+n+'_a/metrics.jsonl'),rows('$R/'+n+'_b/metrics.jsonl')
    keys=lambda r:{k:v for k,v in r.items() if not k.startswith('time') and k not in ('wall_time','load_avg','step_seconds')}
    diff=[(x.get('step'),k) for x,y in zip(a,b) for k in keys(x) if keys(x).get(k)!=keys(y).get(k)]
    print(n, len(a), 'rows; differing (step, key):', diff[:12], len(diff))
"
ls -la $OUT
