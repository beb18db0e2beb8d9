"""visiondist from Python and notebooks (docs/python.md): `train`, `evaluate`, `predict`,
`export` and `benchmark`, the tools' twins (tools/*.py are shells over the same jobs), and `Run`, a
training run's directory with what can be done with it.

`jobs.py`, `export_job.py` and `predict_job.py`: the jobs the tools and these functions share
(`data_job.py`, `plan_job.py`, `k8s_job.py`: those of the tools that stay command lines);
`run.py`: `Run`, `train`, `evaluate`, `export`, `benchmark`; `predicting.py`: `predict` and its
`Result`s; `callbacks.py`: a user's callbacks checked, sent to every rank and handed back. Imported
on first use: `import visiondist` stays light.
"""

from visiondist.utils.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "run": ("Run", "train", "evaluate", "export", "benchmark"),
        "predicting": ("Result", "predict"),
    },
)
