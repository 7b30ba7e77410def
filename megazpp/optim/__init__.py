"""megazpp.optim"""
