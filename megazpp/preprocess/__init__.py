"""megazpp.preprocess"""
