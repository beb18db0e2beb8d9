"""Prediction: a trained model's answers for new images, from the command line (`tools/predict.py`,
sharded over ranks, written to files as it goes, continued after a stop) or from Python (`predict`,
a generator of per-image results).

`sources.py`: what `source=` names (an image, a folder, a glob, a list, a video), as ordered items;
`model.py`: the model loaded as tools/eval.py loads it, the run's evaluation preprocessing;
`names.py`: the names of its outputs; `outputs.py`: the parts each rank writes, their merge into the
task's files, drawing; `run.py`: the batch loop, `predict` and the ranks' entry `predict_ranks`.
Imports the data, models, checkpoint, observe and train rooms; never the launcher.
"""

from visiondist.utils.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "run": ("predict", "predict_ranks", "prediction_config"),
        "sources": ("Source", "resolve_source"),
        "model": ("Predictor", "load_model"),
        "names": ("Names", "read_names"),
    },
)
