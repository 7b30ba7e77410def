"""megazpp.parallel"""
