"""hexa"""
