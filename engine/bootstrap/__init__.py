"""bootstrap"""
