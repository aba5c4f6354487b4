"""The critical-periods study ("time matters in regularising deep networks") at the embedded data's scale.

Networks are trained from scratch with SGD + momentum, an exponential learning-rate decay per epoch and
ordinary weight decay (WD) switched on only in an epoch window [a, b) — the chapter's three protocols:

* **interrupted**: WD on in [0, t0), then off (t0 = 0: never; t0 = E: always);
* **delayed**: WD off until t0, then on to the end (t0 = 0: always; t0 = E: never);
* **sliding window**: WD on only in [t0, t0 + w); its *sensitivity* is the final test accuracy minus that
  of training without WD.

Every run records, per epoch, the trace of the Fisher information on a fixed probe subset of the training
set (labels sampled from the model: :mod:`scrubnet.diagnostics.fisher_trace`), per layer and in total,
‖w_t‖² and η_t/‖w_t‖²; seed 0 also keeps weight snapshots for the trajectory PCA, and for the always/never
runs of seed 0 the linearisation gap from anchors along the run to its final weights. Augmentation (MNIST-1D's
shift + noise) is on throughout where the data set has it, as in the chapter (DA on when WD is studied).

Across all runs of a data set the Pearson correlations (scipy.stats.pearsonr, two-sided p-values) of the
final test accuracy with the peak and the final FIM trace and with the mean initial / final effective
learning rate are reported against the chapter's values, and every claim gets a verdict at this scale.
"""
from scrubnet.experiments.critical_periods.figures import FIGURES, plot_all
from scrubnet.experiments.critical_periods.outputs import (check_result, report_markdown, rerender, run_study,
                                                           write_outputs)
from scrubnet.experiments.critical_periods.study import (CHAPTER_R, CP_RANGES, STUDY_DATASETS,
                                                         TINY_CRITICAL_PERIODS, CriticalPeriodsConfig, RunRecord,
                                                         StudyData, analyse, layer_order_kept, load_study_data,
                                                         pearson, readiness_readout, run_features, run_key,
                                                         scale_text, schedule_windows, train_run, unique_runs,
                                                         verdicts)

__all__ = ["CHAPTER_R", "CP_RANGES", "FIGURES", "STUDY_DATASETS", "TINY_CRITICAL_PERIODS", "CriticalPeriodsConfig",
           "RunRecord", "StudyData", "analyse", "check_result", "layer_order_kept", "load_study_data", "pearson",
           "plot_all", "readiness_readout", "report_markdown", "rerender", "run_features", "run_key", "run_study",
           "scale_text", "schedule_windows", "train_run", "unique_runs", "verdicts", "write_outputs"]
