"""Strategy planner: predicts memory and step time of every PaRO strategy / ZeRO++ combination.

Why a separate package: the planner only adds timing, activation memory and the fit test on
top of `megazpp.zero.traffic` and `megazpp.zero.memory`, whose byte and memory terms the
engine's tests assert. Keeping it out of `megazpp.zero` lets the engine stay free of performance guesses,
and nothing is imported here, so importing one planner module stays cheap.
"""
