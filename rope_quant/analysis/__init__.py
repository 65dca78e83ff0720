"""Reading a study's records: paired statistics, summaries, tables, figures and each kind's report.

The layer above :mod:`rope_quant.sweep` (which runs studies and writes one record per cell) and below
:mod:`rope_quant.cli`. It imports records and manifests, never the runner's machinery; ``rope-quant report``,
``report --against`` and every sweep command's closing report come from here. The comparator, the interval
level and the equivalence rule have one source each (:mod:`rope_quant.defaults`, :mod:`rope_quant.core.verdict`).
"""
