"""The learner stage: samples in, a continuously trained DeepFM out (checkpoints and serving deltas).

Owns: its settings, the model config and the choices among them (``config.py``), the feature config
(``features.py``), Arrow batches -> tensors (``batch.py``), the model from small parts (``model.py``), the sparse
optimizers (``optim.py``) and their update fused into the lookup's backward (``fused_update.py``), the dense
gradient's adaptive clip (``grad_clip.py``), the event clock (``event_clock.py``), the health
monitors (``health.py``: memory, gradient and update norms, coverage), dynamic ids and cold start (``id_map.py``,
``row_mapper.py``, ``cold_start.py``), test-then-train and progressive metrics (``trainer.py``,
``progressive.py``), delayed feedback's weights and base-rate bias (``delayed.py``), served quality
(``served.py``) and the cold/warm and served-quality metrics both daemons keep (``quality.py``), the served logit's
online calibration (``calibration.py``), the Kafka dataset
(``kafka_dataset.py``) with what its DataLoader workers count (``worker_counters.py``) and the lag behind it both
daemons publish (``lag.py``), checkpoints and deltas
(``checkpoint.py``, ``deltas.py``, ``tensorpack.py``), the serving
artifact's layout, build and files (``artifact.py``), its manifest (``artifact_manifest.py``) and the readers
of a publish root (``artifact_versions.py``) with its scorer module (``scorer.py``), the scorer's files
in each format (``scorer_files.py``; the ONNX Runtime scorer in ``onnx_scorer.py``), the daemon (``daemon.py``) and
the offline and online evaluation (``evaluation/``). The distributed mode (``torchrun``, ``WORLD_SIZE > 1``): the
ranks' process group, partition split and lock-step collectives (``distributed.py``), the TorchRec row-wise sharded
model (``sharded_model.py``), its training step (``sharded_trainer.py``) with the boost of young rows around
fbgemm's fused update (``sharded_boost.py``), dynamic ids on N ranks, each field's map sharded with its rows
(``sharded_ids.py``), serving deltas from N ranks (``sharded_deltas.py``), DCP checkpoints and the reshard to one
process (``sharded_checkpoint.py``) and its daemon (``sharded_daemon.py``) with what every rank checks before the
group trains (``rank_checks.py``: the same settings, the same cluster, the checkpoint directory held); only these
import TorchRec.

May import: ``stream/`` and third-party libraries; never ``cache_refresh/``, ``serving/`` or
``monitor/``. Entry points: ``learner.daemon.Learner`` (``streamrec train``),
``learner.evaluation.protocols.evaluate`` (``streamrec evaluate``).
"""
