"""decodekit methods where the user's model lives: transformers models (wrap, processors for transformers'
own generate). Each integration imports its engine lazily, so `import decodekit` needs none of them."""
