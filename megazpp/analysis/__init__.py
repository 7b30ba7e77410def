"""Reading finished runs back: TensorBoard event files -> comparisons, plots, reports.

Why a package of its own: the trainer writes TensorBoard tags and nothing else reads them
inside megazpp; comparing runs ("same loss, faster across the slow link") is a separate job
with its own inputs (event files of runs that may have crashed, resumed or stopped early).
"""
