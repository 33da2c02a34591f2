# The converters' version: raised when the same source, converted with the same arguments, gives other arrays (2:
# weights kept in their stored form, GGUF blocks as Q8_0/Q4_0). Written into each checkpoint (CONVERTER_FILE):
# conversions kept in the cache by an older version are made again.
VERSION = 2
CONVERTER_FILE = "converter.json"
